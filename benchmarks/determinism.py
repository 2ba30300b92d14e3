"""What batch invariance costs: the same seeded workloads with DEEPINFER_BATCH_INVARIANT off and on, in one process.

Two engines are loaded side by side (switch off, switch on). Each repeat draws a fresh seeded workload (new prompts,
so no prefix cache carries over between repeats) and runs it through both, alternating which goes first; the
figures are medians over repeats, and the ratio is the median of the per-repeat ratios (on / off time).

    python benchmarks/determinism.py                          # 64 requests, prompts 32..256, outputs 32..64, 3 repeats
    python benchmarks/determinism.py --batch-sizes 1,32,64    # decode tokens/s at fixed concurrency, off vs on
    python benchmarks/determinism.py --batch-sizes 1,32,64 --dtype float32    # the same on dense float32 weights
    python benchmarks/determinism.py --ops                    # per-op timings on SmolLM2's shapes (where time goes)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    DeepinferRunner,
    default_output_path,
    machine_info,
    median_seconds,
    ordinary_token_ids,
    random_requests,
    workload_summary,
    write_json,
)

MODES = {"off": False, "on": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory; default: bundled SmolLM2")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="workloads per mode; medians over them (default 3)")
    parser.add_argument("--batch-sizes", default=None, help="e.g. 1,32,64: decode tokens/s at each concurrency")
    parser.add_argument("--batch-prompt-len", type=int, default=128)
    parser.add_argument("--ops", action="store_true", help="per-op timings instead of the engine")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--dtype", default=None, help="e.g. float32 (dense weights); default: the model's default "
                        "compute (a GGUF's own blocks)")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per engine (default 1 GiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path; default benchmarks/results/determinism-<time>.json")
    args = parser.parse_args(argv)
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")}) if args.batch_sizes else None
    if args.repeats < 1 or args.threads < 1 or (args.batch_sizes and min(args.batch_sizes) < 1):
        parser.error("--repeats, --threads and --batch-sizes must be >= 1")
    return args


def _median_ratio(on: list[float], off: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(on, off))


def run_engine(args: argparse.Namespace, token_ids: list[int]) -> dict[str, Any]:
    options = {"kv_cache_memory": args.kv_cache_memory, **({"dtype": args.dtype} if args.dtype else {})}
    if args.batch_sizes:
        options["max_num_seqs"] = max(128, max(args.batch_sizes))
    runners = {mode: DeepinferRunner(args.model, args.threads, {**options, "batch_invariant": on})
               for mode, on in MODES.items()}
    warmup = random_requests(2, (16, 16), (4, 4), token_ids, args.seed + 1_000_003)
    for runner in runners.values():
        runner.warmup(warmup)
    if args.batch_sizes:
        plans = [(b, lambda r, b=b: random_requests(b, (args.batch_prompt_len,) * 2, (args.max_output,) * 2,
                                                      token_ids, args.seed + 1000 * r + b)) for b in args.batch_sizes]
    else:
        plans = [(None, lambda r: random_requests(args.num_requests, (args.min_prompt, args.max_prompt),
                                                  (args.min_output, args.max_output), token_ids, args.seed + r))]
    rows = []
    for concurrency, make in plans:
        walls: dict[str, list[float]] = {m: [] for m in MODES}
        decodes: dict[str, list[float]] = {m: [] for m in MODES}
        same = []
        for r in range(args.repeats):
            requests = make(r)
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            tokens = {}
            for mode in order:
                result = runners[mode].run(requests, progress=False)
                walls[mode].append(result.wall_s)
                decodes[mode].append(result.decode_s or float("nan"))
                tokens[mode] = result.token_ids
            same.append(sum(a == b for a, b in zip(tokens["off"], tokens["on"])) / len(requests))
            print(f"  {_label(concurrency)}repeat {r}: off {walls['off'][-1]:.2f}s  on {walls['on'][-1]:.2f}s  "
                  f"ratio {walls['on'][-1] / walls['off'][-1]:.3f}", flush=True)
        summary = workload_summary(requests)
        tokens_per_run = summary["prompt_tokens"] + summary["output_tokens"]
        row = {
            "concurrency": concurrency,
            "workload": summary,
            "wall_s": walls,
            "median_wall_s": {m: statistics.median(v) for m, v in walls.items()},
            "median_total_tok_s": {m: tokens_per_run / statistics.median(v) for m, v in walls.items()},
            "time_ratio_on_off": _median_ratio(walls["on"], walls["off"]),
            "identical_greedy_outputs_off_vs_on": statistics.mean(same),
        }
        if concurrency is not None:
            row["median_decode_tok_s"] = {m: (summary["output_tokens"] - concurrency) / statistics.median(v)
                                          for m, v in decodes.items()}
            row["decode_time_ratio_on_off"] = _median_ratio(decodes["on"], decodes["off"])
        rows.append(row)
    print()
    print(f"{'concurrency':>11} {'off tok/s':>10} {'on tok/s':>10} {'time on/off':>12} {'overhead':>9}")
    for row in rows:
        ratio = row.get("decode_time_ratio_on_off", row["time_ratio_on_off"])
        print(f"{_label(row['concurrency']) or 'workload':>11} {row['median_total_tok_s']['off']:>10.1f} "
              f"{row['median_total_tok_s']['on']:>10.1f} {ratio:>12.3f} {100 * (ratio - 1):>8.1f}%")
    if args.batch_sizes:
        print("(fixed concurrency: the ratio is of decode time, first token of the last request to the end)")
    return {"results": rows}


def _label(concurrency: int | None) -> str:
    return "" if concurrency is None else f"{concurrency}"


def run_ops(args: argparse.Namespace) -> dict[str, Any]:
    """Median time of each invariant op against the default one, on SmolLM2-135M's shapes."""
    import torch
    import torch.nn.functional as F

    from deepinfer.layers.attention import Attention
    from deepinfer.ops import batch_invariant as bi
    from deepinfer.ops import cpu_ops

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.ops.attention_harness import Cache, random_sequence, step

    gen = torch.Generator().manual_seed(args.seed)
    rows = []

    def record(op: str, size: int, base: Callable[[], Any], inv: Callable[[], Any]) -> None:
        # interleaved pairs, so both sides see the same load
        b, i = [], []
        for _ in range(3):
            b.append(median_seconds(base, 3))
            i.append(median_seconds(inv, 3))
        row = {"op": op, "size": size, "default_ms": 1e3 * statistics.median(b), "invariant_ms": 1e3 * statistics.median(i)}
        row["ratio"] = row["invariant_ms"] / row["default_ms"]
        rows.append(row)
        print(f"{op:<34}{size:>6} {row['default_ms']:>9.3f} ms {row['invariant_ms']:>9.3f} ms {row['ratio']:>7.2f}x", flush=True)

    print(f"{'op':<34}{'rows':>6} {'default':>12} {'invariant':>12} {'ratio':>8}")
    ops = cpu_ops.load()  # float32 layers run on its fma-chain kernel where it exists; else on the 32-row tiles
    for name, (n, k) in {"linear qkv 576->960": (960, 576), "linear gate_up 576->3072": (3072, 576),
                         "linear down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}.items():
        w = torch.randn(n, k, generator=gen)
        packed, panels = bi.pack_weight(w), bi.pack_panels(w)
        short = bi.short_tiles(w, None, packed)
        for m in (1, 8, 32, 64, 512):
            x = torch.randn(m, k, generator=gen)
            record(name + " (tiles)", m, lambda: F.linear(x, w), lambda: bi.linear(x, w, None, packed, short))
            if ops is not None:
                record(name + " (kernel)", m, lambda: F.linear(x, w), lambda: ops.dense_linear(x, panels, n, None))
    norm_w = torch.randn(576, generator=gen)
    for m in (32, 512):
        x = torch.randn(m, 576, generator=gen)
        base_norm = lambda: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm_w  # noqa: E731
        record("rms_norm 576", m, base_norm, lambda: bi.rms_norm(x, norm_w, 1e-5))
    layer = Attention(9, 3, 64, 64**-0.5, 0)
    cache = Cache(layer, 1200, 16)
    for batch in (32, 64):
        seqs = [random_sequence(200, layer, list(range(13 * i, 13 * i + 13)), seed=i) for i in range(batch)]
        for s in seqs:
            step(layer, cache, [(s, 0, 199)], invariant=False)
        work = [(s, 199, 1) for s in seqs]
        record("attention decode, context 200", batch, lambda: step(layer, cache, work, False),
               lambda: step(layer, cache, work, True))
    seq = random_sequence(512, layer, list(range(1100, 1132)), seed=99)
    record("attention prefill, 512 tokens", 512, lambda: step(layer, cache, [(seq, 0, 512)], False),
           lambda: step(layer, cache, [(seq, 0, 512)], True))
    return {"ops": rows}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from deepinfer.models.loader import load_model_files, load_tokenizer

    torch.set_num_threads(args.threads)
    payload: dict[str, Any] = {
        "benchmark": "determinism",
        "command": [os.path.basename(sys.argv[0]), *sys.argv[1:]] if argv is None else argv,
        "args": vars(args),
        "machine": machine_info(args.threads),
    }
    if args.ops:
        payload.update(run_ops(args))
    else:
        files = load_model_files(args.model)
        payload["model"] = files.path
        payload.update(run_engine(args, ordinary_token_ids(load_tokenizer(files))))
    payload["load_average_end"] = os.getloadavg()
    print(f"wrote {write_json(payload, args.out or default_output_path('determinism'))}")


if __name__ == "__main__":
    main()
