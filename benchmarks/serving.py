"""Serving benchmark: an asyncio load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process at --request-rate (or back to back: inf), optionally capped at
--concurrency in flight. Every request streams, so time to first token (TTFT), inter-token latency
(ITL, the gaps between streamed chunks) and end-to-end latency are measured on the client.

    python -m deepinfer.cli serve --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --num-prompts 32 --concurrency 8 \
        --input-len 64 --output-len 32 --out benchmarks/results/serving.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm.auto import tqdm

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name").split()


@dataclass
class Prompt:
    text: str
    max_tokens: int


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def synthetic_prompts(count: int, input_len: int, output_len: int, seed: int) -> list[Prompt]:
    """Seeded random word sequences; about one token per word for common English words."""
    rng = random.Random(seed)
    return [Prompt(" ".join(rng.choice(WORDS) for _ in range(input_len)), output_len) for _ in range(count)]


def jsonl_prompts(path: str, count: int, output_len: int) -> list[Prompt]:
    """One JSON object a line with "prompt" and optionally "max_tokens"; cycled up to count."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row.get("prompt"), str):
                    raise ValueError(f"{path}:{number}: expected an object with a string 'prompt', got {line[:80]!r}")
                rows.append(Prompt(row["prompt"], int(row.get("max_tokens", output_len))))
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return [rows[i % len(rows)] for i in range(count)]


async def one_request(http: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: Prompt) -> Result:
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    start = time.perf_counter()
    result = Result(ok=False)
    last: float | None = None
    chunks = 0
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    return result
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
                if not _has_content(event):
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


def _has_content(event: dict) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def run(args: argparse.Namespace, prompts: list[Prompt]) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.concurrency or len(prompts)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as http:
        model = args.model or (await http.get("/models")).raise_for_status().json()["data"][0]["id"]
        gate = asyncio.Semaphore(limit)
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.no_progress)
        rng = random.Random(args.seed + 1)

        async def gated(prompt: Prompt) -> Result:
            async with gate:
                result = await one_request(http, args, model, prompt)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation between closest ranks
        pos = q * (len(ordered) - 1)
        low, high = math.floor(pos), math.ceil(pos)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(args: argparse.Namespace, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        # strict JSON has no Infinity: an unbounded request rate is written as "inf"
        "config": {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                   for k, v in vars(args).items() if k != "api_key"},
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": errors[:5],
        "duration_s": duration,
        "request_throughput_rps": len(ok) / duration,
        "output_throughput_tok_s": output_tokens / duration,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
    }


def print_report(summary: dict[str, Any]) -> None:
    print(f"completed {summary['completed']}, errors {summary['errors']}, in {summary['duration_s']:.2f}s")
    print(f"throughput: {summary['request_throughput_rps']:.3f} req/s, {summary['output_throughput_tok_s']:.2f} output tok/s")
    for name in ("ttft_s", "itl_s", "e2e_s"):
        p = summary[name]
        if p["p50"] is None:
            print(f"{name:7s} n/a")
        else:
            print(f"{name:7s} mean {p['mean'] * 1e3:9.1f} ms  p50 {p['p50'] * 1e3:9.1f}  p90 {p['p90'] * 1e3:9.1f}  "
                  f"p99 {p['p99'] * 1e3:9.1f}")
    for error in summary["error_samples"]:
        print(f"error: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf: all at once")
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight; default: no cap")
    parser.add_argument("--dataset", default=None, help="JSONL with 'prompt' (and 'max_tokens'); default: synthetic")
    parser.add_argument("--input-len", type=int, default=64, help="synthetic prompt length in words (~tokens)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.request_rate <= 0 or (args.concurrency is not None and args.concurrency < 1) or args.num_prompts < 1:
        parser.error("--request-rate must be > 0, --concurrency >= 1 and --num-prompts >= 1")
    if args.dataset:
        prompts = jsonl_prompts(args.dataset, args.num_prompts, args.output_len)
    else:
        prompts = synthetic_prompts(args.num_prompts, args.input_len, args.output_len, args.seed)
    results, duration = asyncio.run(run(args, prompts))
    summary = summarize(args, results, duration)
    print_report(summary)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
