"""Overlap (asynchronous) scheduling on versus off: the decode sweep (benchmarks/sweep.py) at each batch size, once per
mode, each mode in its own process (an engine's OpenMP pools belong to the threads that started them), the same
requests and threads; with --rounds N the two modes take turns N times (the machine drifts between processes) and
each ratio is the median of the rounds' own. Prints throughput, the per-step time breakdown and the on/off ratios;
writes one JSON file.

    python benchmarks/async_scheduling.py --batch-sizes 1,16,64 --threads 2 [--rounds 3]
    python benchmarks/async_scheduling.py --batch-sizes 1,16 --output-len 64 --constrained 0.5  # half under a grammar
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info  # noqa: E402


def run_mode(mode: bool, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "points.jsonl")
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "sweep.py"),
                        "--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len),
                        "--output-len", str(args.output_len), "--threads", str(args.threads),
                        "--constrained", str(args.constrained),
                        "--engine-option", f"async_scheduling={'true' if mode else 'false'}", "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return [json.loads(line) for line in f if line.strip()]


def _median_round(rounds: list[dict]) -> dict:
    """Per batch size, each mode's point from the round with its median throughput."""
    out = {}
    for mode in (False, True):
        out[mode] = [sorted((r[mode][i] for r in rounds), key=lambda p: p["total_tok_s"])[len(rounds) // 2]
                     for i in range(len(rounds[0][mode]))]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--constrained", type=float, default=0.0,
                        help="the share of each batch's requests under a JSON schema (sweep.py --constrained)")
    parser.add_argument("--rounds", type=int, default=1, help="off and on take turns this many times")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = [{mode: run_mode(mode, args) for mode in (False, True)} for _ in range(args.rounds)]
    points = _median_round(rounds)
    rows = []
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'off outside fwd':>16} {'on outside fwd':>15}"
          f"  step ms off -> on (schedule / prepare / forward / sample / update / output)")
    for off, on in zip(points[False], points[True]):
        ratio = on["total_tok_s"] / off["total_tok_s"]
        phases = ("schedule", "prepare", "forward", "sample", "update", "output")
        steps = " / ".join(f"{off['step_ms'][p]:.2f}->{on['step_ms'][p]:.2f}" for p in phases)
        print(f"{off['batch']:>5} {off['total_tok_s']:>10.1f} {on['total_tok_s']:>10.1f} {ratio:>7.3f} "
              f"{100 * off['outside_forward']:>15.1f}% {100 * on['outside_forward']:>14.1f}%  {steps}")
        rows.append({"batch": off["batch"], "off": off, "on": on, "on_over_off": ratio})
    if args.rounds > 1:
        for i, row in enumerate(rows):
            ratios = [r[True][i]["total_tok_s"] / r[False][i]["total_tok_s"] for r in rounds]
            row["on_over_off"], row["round_ratios"] = statistics.median(ratios), ratios
            print(f"batch {row['batch']}: on/off median {row['on_over_off']:.3f} over {args.rounds} rounds "
                  f"({min(ratios):.3f}-{max(ratios):.3f})")
    out = args.out or default_output_path("async_scheduling", ".json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": machine_info(args.threads), "args": vars(args), "points": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
