"""What throughput.py --batch-sizes reports beside decode: prompt processing of one long prompt, batch-1
generation, the weights' memory, and each deepinfer row's ratio to the best peer at the same point."""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Sequence

from common import RunResult, random_requests

PEERS = ("llama.cpp", "llama-cpp-python", "vllm", "vllm-bf16", "transformers")


def measure_extras(runner, args: argparse.Namespace, model_path: str, token_ids: Sequence[int]) -> dict[str, Any]:
    """pp_tok_s: one prompt of --prefill-len tokens and one output token (median of 3 fresh prompts), or
    llama-bench's pp for llama.cpp; weight_bytes where the engine can say."""
    extras: dict[str, Any] = {}
    if runner.name == "llama.cpp":
        bench = runner.prompt_and_generation(args.prefill_len, args.max_output)
        extras.update(pp_tok_s=bench["pp_tok_s"], tg_tok_s=bench["tg_tok_s"], weight_bytes=bench["model_bytes"],
                      llama_bench=bench)
        return extras
    walls = []
    for i in range(3):
        (request,) = random_requests(1, (args.prefill_len, args.prefill_len), (1, 1), token_ids, args.seed + 7919 * (i + 1))
        walls.append(runner.run([request], progress=False).wall_s)
    extras["pp_tok_s"] = args.prefill_len / statistics.median(walls)
    if hasattr(runner, "weight_bytes"):
        extras["weight_bytes"] = runner.weight_bytes()
        extras["rss_bytes"] = _rss()
    return extras


def _rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def report_extras(engines: dict[str, dict[str, Any]], results: list[tuple[int | None, RunResult]],
                  model_path: str) -> dict[str, Any]:
    """Prints prompt processing and memory per engine, then deepinfer's ratios to the best peer per concurrency."""
    file_bytes = os.path.getsize(model_path) if os.path.isfile(model_path) else None
    print(f"{'engine':<18}{'pp tok/s':>10}{'tg@1 tok/s':>12}{'weights MiB':>13}{'x file':>8}")
    for engine, info in engines.items():
        if info.get("status") != "ran":
            continue
        weights = info.get("weight_bytes")
        ratio = weights / file_bytes if weights and file_bytes else None
        print(f"{engine:<18}{_fmt(info.get('pp_tok_s')):>10}{_fmt(info.get('tg_tok_s')):>12}"
              f"{_fmt(weights and weights / 2**20):>13}{_fmt(ratio, '.2f'):>8}")
    summary: dict[str, Any] = {}
    print(f"\n{'concurrency':>11}  {'best peer':<18}{'peer tok/s':>11}{'deepinfer':>11}{'ratio':>8}   (end-to-end output tok/s)")
    for concurrency in sorted({c for c, _ in results if c is not None}):
        rows = {r.engine: r for c, r in results if c == concurrency}
        peers = {e: r.output_tok_s for e, r in rows.items() if e in PEERS}
        if "deepinfer" not in rows or not peers:
            continue
        best = max(peers, key=peers.get)
        ratio = rows["deepinfer"].output_tok_s / peers[best]
        summary[str(concurrency)] = {"best_peer": best, "peer_tok_s": peers[best],
                                     "deepinfer_tok_s": rows["deepinfer"].output_tok_s, "ratio": ratio}
        print(f"{concurrency:>11}  {best:<18}{peers[best]:>11.1f}{rows['deepinfer'].output_tok_s:>11.1f}{ratio:>7.2f}x")
    pp = {e: i["pp_tok_s"] for e, i in engines.items() if i.get("pp_tok_s") and e in PEERS}
    if pp and engines.get("deepinfer", {}).get("pp_tok_s"):
        best = max(pp, key=pp.get)
        summary["prompt_processing"] = {"best_peer": best, "peer_tok_s": pp[best],
                                        "deepinfer_tok_s": engines["deepinfer"]["pp_tok_s"],
                                        "ratio": engines["deepinfer"]["pp_tok_s"] / pp[best]}
        print(f"{'pp':>11}  {best:<18}{pp[best]:>11.1f}{engines['deepinfer']['pp_tok_s']:>11.1f}"
              f"{summary['prompt_processing']['ratio']:>7.2f}x")
    return summary


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else f"{value:{spec}}"
