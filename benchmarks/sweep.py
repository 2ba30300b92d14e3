"""Decode-batch sweep: at each batch size, that many requests decode together; one JSON line per point and the
Pareto curve (total tokens/s against tokens/s per user) as a PNG.

Offline mode drives the engine step by step (every request's token times come from the steps that produced
them) and records where each step's time went (engine/timing.py). `--url` runs the same points against a running
OpenAI-compatible server over HTTP instead (streaming completions; TTFT and ITL from the chunks' arrival).

    python benchmarks/sweep.py --batch-sizes 8,16,32,64,128,256 --prompt-len 128 --output-len 128
    python benchmarks/sweep.py --url http://127.0.0.1:8000/v1 --batch-sizes 8,16
    python benchmarks/sweep.py --batch-sizes 1,16 --constrained 0.5   # half the requests follow a JSON schema
    examples/sweep/run_sweep.sh                              # the same, with the defaults above
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, ordinary_token_ids, random_requests  # noqa: E402
from structured import SCHEMA  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="8,16,32,64,128,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", default=None, help="offline mode: the model (default: bundled SmolLM2)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="offline mode: an LLM option, e.g. dtype=float32 (values parsed as JSON if they can be)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--url", default=None, help="server mode: the server's /v1 base URL")
    parser.add_argument("--served-model", default=None, help="server mode: the model name (default: the first listed)")
    parser.add_argument("--out", default=None, help="JSONL path; default benchmarks/results/sweep-<timestamp>.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--constrained", type=float, default=0.0,
                        help="offline mode: the share of each batch's requests (rounded up) whose output follows a JSON "
                             "schema no request finishes within --output-len (structured.py's array of orders)")
    args = parser.parse_args(argv)
    if not 0 <= args.constrained <= 1 or (args.constrained and args.url):
        parser.error("--constrained is a share in [0, 1], offline mode only")
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    if not args.batch_sizes or min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.output_len < 2:
        parser.error("batch sizes and --prompt-len must be >= 1, --output-len >= 2")
    options = {}
    for text in args.engine_option:
        key, _, raw = text.partition("=")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    args.engine_options = options
    return args


def summarize(batch: int, starts: dict[str, float], token_times: dict[str, list[float]], wall: float) -> dict[str, Any]:
    ttft = [times[0] - starts[rid] for rid, times in token_times.items()]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    tokens = sum(len(t) for t in token_times.values())
    decode = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times.values() if len(times) > 1]
    q = statistics.quantiles(itl, n=100) if len(itl) >= 2 else [itl[0]] * 99 if itl else [0.0] * 99
    return {"batch": batch, "total_tok_s": tokens / wall, "per_user_tok_s": 1 / statistics.median(decode),
            "ttft_p50_s": statistics.median(ttft), "itl_p50_ms": 1e3 * q[49], "itl_p99_ms": 1e3 * q[98],
            "wall_s": wall, "output_tokens": tokens}


def offline_point(llm, batch: int, args, token_ids) -> dict[str, Any]:
    from deepinfer import SamplingParams

    engine = llm.engine
    requests = random_requests(batch, (args.prompt_len,) * 2, (args.output_len,) * 2, token_ids, args.seed + batch)
    # deltas, as a streaming server asks for them: each output holds the tokens its step made
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, output_kind="delta")
    constrained = params.replace(so_args={"schema_type": "json", "schema": SCHEMA})
    first_free = math.ceil(args.constrained * batch)  # requests 0 .. first_free - 1 follow the schema
    before = engine.step_times.copy()
    starts, times = {}, {}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        rid = f"sweep-{batch}-{i}"
        engine.add_request(rid, r.prompt_token_ids, constrained if i < first_free else params)
        starts[rid], times[rid] = start, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request_id] += [now] * len(out.outputs[0].token_ids)
    point = summarize(batch, starts, times, time.perf_counter() - start)
    steps = engine.step_times.since(before)
    point["step_ms"] = steps.per_step_ms()
    point["outside_forward"] = steps.outside_forward
    return point


async def server_point(url: str, model: str, batch: int, args, token_ids) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
    requests = random_requests(batch, (args.prompt_len,) * 2, (args.output_len,) * 2, token_ids, args.seed + batch)
    starts, times = {}, {}

    async def one(i: int, prompt: list[int]) -> None:
        rid = str(i)
        starts[rid], times[rid] = time.perf_counter(), []
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.output_len,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times[rid].append(time.perf_counter())

    start = time.perf_counter()
    await asyncio.gather(*(one(i, r.prompt_token_ids) for i, r in enumerate(requests)))
    return summarize(batch, starts, {k: v for k, v in times.items() if v}, time.perf_counter() - start)


def plot(points: list[dict[str, Any]], path: str, title: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs, ys = [p["per_user_tok_s"] for p in points], [p["total_tok_s"] for p in points]
    ax.plot(xs, ys, marker="o")
    for p in points:
        ax.annotate(f"batch {p['batch']}", (p["per_user_tok_s"], p["total_tok_s"]), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
    ax.set_xlabel("tokens/s per user")
    ax.set_ylabel("total output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out or default_output_path("sweep", ".jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    points = []
    if args.url:
        from openai import OpenAI
        from transformers import AutoTokenizer  # noqa: F401  (token ids are sent, so any id in range works)

        model = args.served_model or OpenAI(base_url=args.url, api_key="none").models.list().data[0].id
        token_ids = list(range(1000, 20000))
        title = f"{model} over HTTP"
    else:
        import torch

        from deepinfer import LLM

        torch.set_num_threads(args.threads)
        llm = LLM(args.model, num_threads=args.threads, max_num_seqs=max(args.batch_sizes),
                  max_num_batched_tokens=max(2048, args.prompt_len), **args.engine_options)
        token_ids = ordinary_token_ids(llm.get_tokenizer())
        offline_point(llm, 2, args, token_ids)  # warm-up
        title = f"{os.path.basename(llm.engine.model_path)} ({llm.engine.compute.name}), {args.threads} threads"
    with open(out, "w") as f:
        for batch in args.batch_sizes:
            point = asyncio.run(server_point(args.url, model, batch, args, token_ids)) if args.url \
                else offline_point(llm, batch, args, token_ids)
            point.update(prompt_len=args.prompt_len, output_len=args.output_len, mode="http" if args.url else "offline")
            points.append(point)
            f.write(json.dumps(point) + "\n")
            f.flush()
            print(f"batch {batch:>4}: total {point['total_tok_s']:8.1f} tok/s, per user {point['per_user_tok_s']:6.1f} "
                  f"tok/s, TTFT p50 {point['ttft_p50_s']:.2f} s, ITL p50/p99 {point['itl_p50_ms']:.1f}/"
                  f"{point['itl_p99_ms']:.1f} ms" + (f", outside forward {100 * point['outside_forward']:.1f}%"
                                                     if "outside_forward" in point else ""), flush=True)
    png = plot(points, os.path.splitext(out)[0] + ".png", title)
    with open(os.path.splitext(out)[0] + ".meta.json", "w") as f:
        json.dump({"machine": machine_info(args.threads), "args": {k: v for k, v in vars(args).items()}}, f, indent=2)
    print(f"wrote {out}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
