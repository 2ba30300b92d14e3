"""Offline throughput: deepinfer against Hugging Face transformers, llama.cpp and vLLM on one seeded workload.

Default mode: a fixed, seeded set of requests (256; prompts 32..512 tokens, outputs 32..256) run through every
engine in turn, same token ids, exact output lengths (greedy, EOS ignored), float32 for the torch engines, the same
thread count everywhere. Prints a table of output and total tokens/s with ratios against transformers, and writes
JSON. `--batch-sizes 1,4,16,32,64` instead measures decode throughput at fixed concurrency (every request has
--batch-prompt-len prompt tokens and --max-output output tokens), prompt processing of one --prefill-len prompt,
and the weights' memory, and also writes a PNG plot. With `--rounds N` every engine runs every point N times,
taking turns in a rotating order on fresh prompts each round (benchmarks/rounds.py): on a machine whose memory
bandwidth drifts, one pass per engine can put two engines in different spells; quote the medians.

Engines: `deepinfer` (its default: a GGUF model computes on its quantized blocks), `deepinfer-f32` (dense
float32), `transformers` (float32), `llama.cpp` (its own llama-bench / llama-batched-bench, with --llama-bin),
`llama-cpp-python` (sequential), `vllm` / `vllm-bf16` (with --vllm-python).

    python benchmarks/throughput.py                                      # the full workload (tens of minutes)
    python benchmarks/throughput.py --num-requests 16 --max-prompt 128 --max-output 32
    python benchmarks/throughput.py --batch-sizes 1,16,64 --max-output 128 --llama-bin ~/llama.cpp/build/bin \
        --vllm-python ~/vllm-venv/bin/python --vllm-model ~/smollm2-hf --rounds 5
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    BenchRequest,
    DeepinferRunner,
    EngineUnavailable,
    Runner,
    RunResult,
    TransformersRunner,
    default_output_path,
    greedy_agreement,
    machine_info,
    ordinary_token_ids,
    random_requests,
    workload_summary,
    write_json,
)
from peers import LlamaCppRunner, LlamaToolsRunner, VllmRunner  # noqa: E402
from rounds import ROUND_SEED_STRIDE, median_extras, median_results, rotation  # noqa: E402
from speed_extras import measure_extras, report_extras  # noqa: E402

ENGINES = ("deepinfer", "deepinfer-f32", "transformers", "llama.cpp", "llama-cpp-python", "vllm", "vllm-bf16")
BASELINE = "transformers"
WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from measured ones, so no prefix cache can carry over


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory; default: bundled SmolLM2")
    parser.add_argument("--engines", default=None,
                        help=f"comma list from {','.join(ENGINES)}; default: deepinfer,deepinfer-f32,transformers "
                             "(+llama.cpp with --llama-bin, +vllm,vllm-bf16 with --vllm-python); an engine that "
                             "cannot run here is skipped with the reason")
    parser.add_argument("--num-requests", type=int, default=256, help="workload size (default %(default)s)")
    parser.add_argument("--min-prompt", type=int, default=32, help="shortest prompt, tokens (default %(default)s)")
    parser.add_argument("--max-prompt", type=int, default=512, help="longest prompt, tokens (default %(default)s)")
    parser.add_argument("--min-output", type=int, default=32, help="shortest output, tokens (default %(default)s)")
    parser.add_argument("--max-output", type=int, default=256,
                        help="longest output, tokens; also the output length with --batch-sizes (default %(default)s)")
    parser.add_argument("--batch-sizes", type=_int_list, default=None,
                        help="e.g. 1,4,16,32,64: decode throughput at each fixed concurrency instead of the workload")
    parser.add_argument("--batch-prompt-len", type=int, default=128,
                        help="prompt length with --batch-sizes (default %(default)s)")
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="transformers' static batch size in the workload (default %(default)s)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads for every engine (default: the CPUs available, %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    parser.add_argument("--deepinfer-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an LLM engine option, e.g. max_num_seqs=64; repeatable; values parsed as JSON if they can be")
    parser.add_argument("--prefill-len", type=int, default=512,
                        help="with --batch-sizes: prompt processing of one prompt this long (default %(default)s)")
    parser.add_argument("--llamacpp-n-batch", type=int, default=512, help="llama-cpp-python n_batch (default %(default)s)")
    parser.add_argument("--llama-bin", default=None, help="directory with llama.cpp's llama-bench and llama-batched-bench")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm; runs vLLM as a peer")
    parser.add_argument("--vllm-model", default=None,
                        help="the Hugging Face directory vLLM loads (a GGUF dequantized with transformers); "
                             "default: --model")
    parser.add_argument("--out", default=None, help="JSON path; default benchmarks/results/throughput-<timestamp>.json")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --batch-sizes: run every engine at every point this many times, taking turns "
                        "(fresh prompts each round; tables show the median round, ratios the median of each round's "
                        "own ratio; default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = parser.parse_args(argv)

    default = (["deepinfer", "deepinfer-f32", "transformers"] + (["llama.cpp"] if args.llama_bin else [])
               + (["vllm", "vllm-bf16"] if args.vllm_python else []))
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()] if args.engines else default
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or not args.engines:
        parser.error(f"--engines must name some of {ENGINES}, got {unknown or args.engines}")
    if args.rounds > 1 and not args.batch_sizes:
        parser.error("--rounds needs --batch-sizes (the workload mode runs each engine once)")
    for name in ("num_requests", "max_prompt", "max_output", "batch_prompt_len", "hf_batch_size", "threads", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.deepinfer_options = dict(_option(o, parser) for o in args.deepinfer_option)
    # Scaling a maximum below the default minimum (--max-output 16) shrinks the range to that one length.
    args.min_prompt = min(args.min_prompt, args.max_prompt)
    args.min_output = min(args.min_output, args.max_output)
    if args.min_prompt < 1 or args.min_output < 1:
        parser.error(f"--min-prompt and --min-output must be >= 1, got {args.min_prompt} and {args.min_output}")
    return args


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return sorted(set(values))


def _option(text: str, parser: argparse.ArgumentParser) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        parser.error(f"--deepinfer-option expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def plan_requests(args: argparse.Namespace, token_ids: list[int], round_index: int = 0
                  ) -> list[tuple[int | None, list[BenchRequest]]]:
    """(concurrency or None, requests) pairs; each concurrency and each round gets its own seed, so its prompts are
    new."""
    if args.batch_sizes:
        length = min(args.batch_prompt_len, args.max_prompt)
        seed = args.seed + ROUND_SEED_STRIDE * round_index
        return [(b, random_requests(b, (length, length), (args.max_output, args.max_output), token_ids, seed + b))
                for b in args.batch_sizes]
    return [(None, random_requests(args.num_requests, (args.min_prompt, args.max_prompt),
                                   (args.min_output, args.max_output), token_ids, args.seed))]


def make_runner(engine: str, args: argparse.Namespace, model_path: str, n_ctx: int) -> Runner:
    if engine in ("deepinfer", "deepinfer-f32"):
        options = dict(args.deepinfer_options)
        if engine == "deepinfer-f32":
            options["dtype"] = "float32"
        if args.batch_sizes and max(args.batch_sizes) > 128:  # the default max_num_seqs; all must run at once
            options.setdefault("max_num_seqs", max(args.batch_sizes))
        return DeepinferRunner(model_path, args.threads, options, name=engine)
    if engine == "transformers":
        # In --batch-sizes mode each run holds exactly `concurrency` requests: one static batch.
        return TransformersRunner(model_path, args.threads, max(args.batch_sizes) if args.batch_sizes else args.hf_batch_size)
    if engine == "llama.cpp":
        return LlamaToolsRunner(args.llama_bin, model_path, args.threads)
    if engine == "llama-cpp-python":
        return LlamaCppRunner(model_path, args.threads, n_ctx, args.llamacpp_n_batch)
    return VllmRunner(args.vllm_python, args.vllm_model or model_path, args.threads,
                      measure_decode=bool(args.batch_sizes), dtype="bfloat16" if engine == "vllm-bf16" else "float32")


def run_engines(args: argparse.Namespace, model_path: str, token_ids: list[int], warmup: list[BenchRequest]):
    """(each round's results, engines). One round: each engine in turn, closed before the next starts (it gets the
    memory back). More: every engine open at once and each round runs them all, in rotation (rounds.py)."""
    plans = [plan_requests(args, token_ids, r) for r in range(args.rounds)]
    n_ctx = max(len(r.prompt_token_ids) + r.output_len
                for rounds in plans for _, requests in rounds for r in requests + warmup)
    per_round: list[list[tuple[int | None, RunResult]]] = [[] for _ in range(args.rounds)]
    engines: dict[str, dict[str, Any]] = {}
    extras: dict[str, list[dict[str, Any]]] = {}
    for group in ([[e] for e in args.engines] if args.rounds == 1 else [args.engines]):
        runners = {}
        try:
            for engine in group:
                runner = _open(engine, args, model_path, n_ctx, warmup, engines)
                if runner is not None:
                    runners[engine] = runner
            for r in range(args.rounds):
                if args.rounds > 1:
                    print(f"== round {r + 1} of {args.rounds}", flush=True)
                for engine in rotation(list(runners), r):
                    print(f"== {engine}", flush=True)
                    for concurrency, requests in plans[r]:
                        result = runners[engine].run(requests, progress=not args.no_progress)
                        per_round[r].append((concurrency, result))
                        print(f"   {_label(concurrency)}{result.output_tokens} output tokens in {result.wall_s:.2f}s: "
                              f"{result.output_tok_s:.1f} out tok/s", flush=True)
                    if args.batch_sizes:
                        extras.setdefault(engine, []).append(
                            measure_extras(runners[engine], args, model_path, token_ids, r))
            for engine, runner in runners.items():  # a runner may have changed how it runs (peers.py's llama.cpp)
                engines[engine]["mode"] = runner.mode
        finally:
            for runner in runners.values():
                runner.close()
            runners.clear()
            gc.collect()  # the next engine gets the memory back
    for engine, rounds in extras.items():
        engines[engine].update(median_extras(rounds))
    return per_round, engines


def _open(engine: str, args: argparse.Namespace, model_path: str, n_ctx: int, warmup: list[BenchRequest],
          engines: dict[str, dict[str, Any]]) -> Runner | None:
    """The warmed-up runner, or None with the reason in engines: a peer that cannot start costs only its own rows."""
    print(f"== starting {engine}", flush=True)
    try:
        runner = make_runner(engine, args, model_path, n_ctx)
    except EngineUnavailable as e:
        print(f"   skipped: {e}", flush=True)
        engines[engine] = {"status": "skipped", "reason": str(e)}
        return None
    except Exception as e:
        print(f"   failed to start: {type(e).__name__}: {e}", flush=True)
        engines[engine] = {"status": "skipped", "reason": f"failed to start: {e}"}
        return None
    try:
        runner.warmup(warmup)
    except BaseException:
        runner.close()
        raise
    engines[engine] = {"status": "ran", "mode": runner.mode}
    return runner


def _label(concurrency: int | None) -> str:
    return "" if concurrency is None else f"concurrency {concurrency}: "


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value and base else None


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _same(agreement: dict[str, float] | None) -> str:
    """The share of output tokens before the first divergence from transformers' greedy output."""
    return "-" if not agreement else f"{100 * agreement['matched_prefix_tokens']:.0f}%"


def report_workload(results: list[tuple[int | None, RunResult]]) -> list[dict[str, Any]]:
    base = next((r for _, r in results if r.engine == BASELINE), None)
    header = (f"{'engine':<13}{'requests':>9}{'prompt tok':>12}{'output tok':>12}{'wall s':>9}"
              f"{'out tok/s':>11}{'total tok/s':>13}{'out x HF':>10}{'total x HF':>12}{'same as HF':>12}")
    print(header, "-" * len(header), sep="\n")
    rows = []
    for _, r in results:
        out_ratio = _ratio(r.output_tok_s, base and base.output_tok_s)
        total_ratio = _ratio(r.total_tok_s, base and base.total_tok_s)
        agreement = base and greedy_agreement(r, base)
        print(f"{r.engine:<13}{r.num_requests:>9}{r.prompt_tokens:>12}{r.output_tokens:>12}{r.wall_s:>9.1f}"
              f"{r.output_tok_s:>11.1f}{r.total_tok_s:>13.1f}{_fmt(out_ratio, '.2f', 'x'):>10}"
              f"{_fmt(total_ratio, '.2f', 'x'):>12}{_same(agreement):>12}")
        row = {**r.to_dict(), "output_ratio_vs_transformers": out_ratio, "total_ratio_vs_transformers": total_ratio,
               "greedy_agreement_vs_transformers": agreement}
        for key in ("decode_s", "decode_tok_s"):  # requests here do not all run at once: no clean decode phase
            row.pop(key)
        rows.append(row)
    return rows


def report_batches(results: list[tuple[int | None, RunResult]], first_round: list[tuple[int | None, RunResult]]
                   ) -> list[dict[str, Any]]:
    """Rates from `results` (each point's median round); agreement with transformers from the first round, where
    every engine had the same prompts."""
    base = {c: r for c, r in results if r.engine == BASELINE}
    same_prompts = {(c, r.engine): r for c, r in first_round}
    header = (f"{'concurrency':>11}  {'engine':<13}{'output tok':>11}{'wall s':>9}{'out tok/s':>11}"
              f"{'decode tok/s':>14}{'out x HF':>10}{'decode x HF':>13}{'same as HF':>12}")
    print(header, "-" * len(header), sep="\n")
    rows = []
    for concurrency, r in sorted(results, key=lambda item: (item[0], item[1].engine)):
        hf = base.get(concurrency)
        out_ratio = _ratio(r.output_tok_s, hf and hf.output_tok_s)
        decode_ratio = _ratio(r.decode_tok_s, hf and hf.decode_tok_s)
        reference = same_prompts.get((concurrency, BASELINE))
        agreement = reference and greedy_agreement(same_prompts[(concurrency, r.engine)], reference)
        print(f"{concurrency:>11}  {r.engine:<13}{r.output_tokens:>11}{r.wall_s:>9.1f}{r.output_tok_s:>11.1f}"
              f"{_fmt(r.decode_tok_s):>14}{_fmt(out_ratio, '.2f', 'x'):>10}{_fmt(decode_ratio, '.2f', 'x'):>13}"
              f"{_same(agreement):>12}")
        rows.append({**r.to_dict(), "concurrency": concurrency, "output_ratio_vs_transformers": out_ratio,
                     "decode_ratio_vs_transformers": decode_ratio, "greedy_agreement_vs_transformers": agreement})
    return rows


def plot_batches(rows: list[dict[str, Any]], path: str, title: str) -> str | None:
    """Decode tokens/s (solid) and end-to-end output tokens/s (dashed) against concurrency, one colour per engine."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, engine in enumerate(dict.fromkeys(row["engine"] for row in rows)):
        mine = sorted((row for row in rows if row["engine"] == engine), key=lambda row: row["concurrency"])
        xs = [row["concurrency"] for row in mine]
        color = f"C{index}"
        ax.plot(xs, [row["decode_tok_s"] for row in mine], marker="o", color=color, label=f"{engine} decode")
        ax.plot(xs, [row["output_tok_s"] for row in mine], linestyle="--", marker=".", color=color, alpha=0.6,
                label=f"{engine} end to end")
    concurrencies = sorted({row["concurrency"] for row in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from deepinfer.models.loader import load_model_files, load_tokenizer

    torch.set_num_threads(args.threads)  # before anything runs, so both torch engines use the same count
    files = load_model_files(args.model)
    token_ids = ordinary_token_ids(load_tokenizer(files))
    warmup = random_requests(2, (16, 16), (4, 4), token_ids, args.seed + WARMUP_SEED_OFFSET)
    machine = machine_info(args.threads)

    per_round, engines = run_engines(args, files.path, token_ids, warmup)
    results = median_results(per_round)
    print()
    if not results:
        print("no engine ran")
    rows = [] if not results else report_batches(results, per_round[0]) if args.batch_sizes else report_workload(results)
    summary = None
    if args.batch_sizes:
        print()
        summary = report_extras(engines, results, files.path, per_round)
    for engine, info in engines.items():
        print(f"{engine}: {info.get('mode') or 'skipped: ' + info['reason']}")

    out = args.out or default_output_path("throughput")
    payload = {
        "benchmark": "throughput",
        "mode": "batch_sizes" if args.batch_sizes else "workload",
        "command": [os.path.basename(sys.argv[0]), *sys.argv[1:]] if argv is None else argv,
        "args": {k: v for k, v in vars(args).items() if k != "deepinfer_option"},
        "model": files.path,
        "machine": machine,
        "load_average_end": os.getloadavg(),
        "workloads": [{"concurrency": c, **workload_summary(reqs)} for c, reqs in plan_requests(args, token_ids)],
        "engines": engines,
        "results": rows,
        "versus_best_peer": summary,
    }
    write_json(payload, out)  # before the plot: a plotting failure never loses the measurements
    if args.batch_sizes and rows:
        title = (f"{os.path.basename(files.path)}, prompt {min(args.batch_prompt_len, args.max_prompt)}, "
                 f"output {args.max_output}, threads={args.threads}")
        payload["plot"] = plot_batches(rows, os.path.splitext(out)[0] + ".png", title)
        if payload["plot"]:
            print(f"wrote {payload['plot']}")
    print(f"wrote {write_json(payload, out)}")


if __name__ == "__main__":
    main()
