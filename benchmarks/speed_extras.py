"""What throughput.py --batch-sizes reports beside decode: prompt processing of one long prompt, batch-1
generation, the weights' memory, and each deepinfer row's ratio to the best peer at the same point."""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Sequence

from common import RunResult, random_requests
from rounds import ROUND_SEED_STRIDE, round_ratios

PEERS = ("llama.cpp", "llama-cpp-python", "vllm", "vllm-bf16", "transformers")


def measure_extras(runner, args: argparse.Namespace, model_path: str, token_ids: Sequence[int],
                   round_index: int = 0) -> dict[str, Any]:
    """pp_tok_s: one prompt of --prefill-len tokens and one output token (median of 3 prompts new to this round),
    or llama-bench's pp for llama.cpp; weight_bytes where the engine can say."""
    extras: dict[str, Any] = {}
    if runner.name == "llama.cpp":
        bench = runner.prompt_and_generation(args.prefill_len, args.max_output)
        extras.update(pp_tok_s=bench["pp_tok_s"], tg_tok_s=bench["tg_tok_s"], weight_bytes=bench["model_bytes"],
                      llama_bench=bench)
        return extras
    walls = []
    for i in range(3):
        (request,) = random_requests(1, (args.prefill_len, args.prefill_len), (1, 1), token_ids,
                                     args.seed + ROUND_SEED_STRIDE * round_index + 7919 * (i + 1))
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
                  model_path: str, per_round: Sequence[Sequence[tuple[int | None, RunResult]]] = ()) -> dict[str, Any]:
    """Prints prompt processing and memory per engine, then deepinfer's ratios to the best peer per concurrency.
    With several rounds (per_round), the best peer is the one with the highest median and the ratio is the
    median of each round's own ratio, its range beside it."""
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
    print(f"\n{'concurrency':>11}  {'best peer':<18}{'peer tok/s':>11}{'deepinfer':>11}{'ratio':>8}   "
          f"(end-to-end output tok/s{'; median of rounds, range' if len(per_round) > 1 else ''})")
    for concurrency in sorted({c for c, _ in results if c is not None}):
        rows = {r.engine: r for c, r in results if c == concurrency}
        peers = {e: r.output_tok_s for e, r in rows.items() if e in PEERS}
        if "deepinfer" not in rows or not peers:
            continue
        best = max(peers, key=peers.get)
        point = _point(best, peers[best], rows["deepinfer"].output_tok_s,
                       round_ratios(per_round, concurrency, "deepinfer", best))
        summary[str(concurrency)] = point
        print(f"{concurrency:>11}  {best:<18}{peers[best]:>11.1f}{point['deepinfer_tok_s']:>11.1f}"
              f"{point['ratio']:>7.2f}x{_range(point)}")
    pp = {e: i["pp_tok_s"] for e, i in engines.items() if i.get("pp_tok_s") and e in PEERS}
    if pp and engines.get("deepinfer", {}).get("pp_tok_s"):
        best = max(pp, key=pp.get)
        ours, theirs = engines["deepinfer"].get("rounds_pp_tok_s"), engines[best].get("rounds_pp_tok_s")
        each = [a / b for a, b in zip(ours, theirs)] if ours and theirs and len(ours) == len(theirs) else []
        point = summary["prompt_processing"] = _point(best, pp[best], engines["deepinfer"]["pp_tok_s"], each)
        print(f"{'pp':>11}  {best:<18}{pp[best]:>11.1f}{point['deepinfer_tok_s']:>11.1f}{point['ratio']:>7.2f}x"
              f"{_range(point)}")
    return summary


def _point(peer: str, peer_tok_s: float, ours: float, each_round: Sequence[float]) -> dict[str, Any]:
    point = {"best_peer": peer, "peer_tok_s": peer_tok_s, "deepinfer_tok_s": ours, "ratio": ours / peer_tok_s}
    if len(each_round) > 1:
        point.update(ratio=statistics.median(each_round), rounds_ratio=list(each_round))
    return point


def _range(point: dict[str, Any]) -> str:
    each = point.get("rounds_ratio")
    return f"   {min(each):.2f}-{max(each):.2f}x over {len(each)} rounds" if each else ""


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else f"{value:{spec}}"
