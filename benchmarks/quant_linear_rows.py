"""The quantized linear kernel by row count: SmolLM2's layer shapes, variants of the compiled ops taking turns.

A variant is the ops built with `-D` flags (`DI_ROW_CHUNK=rows`: rows per pass over a thread's weight blocks, see
quant_linear.cpp) or from another copy of the sources (an older commit's, to compare a change):

    python benchmarks/quant_linear_rows.py                                      # row chunks of 128 against none
    git archive c42827b deepinfer/ops/csrc | tar -x -C /tmp/old
    python benchmarks/quant_linear_rows.py --variants "src=/tmp/old/deepinfer/ops/csrc;"   # that commit vs now

Random weights in SmolLM2's formats (Q4_1 for the layers, Q8_0 for the tied head), float32 activations; every
variant must give the first one's bits (checked). Medians of --repeats per shape and row count; ratios against the
first variant, and per-thread GMAC/s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_json  # noqa: E402

from deepinfer.ops import cpu_ops  # noqa: E402
from deepinfer.ops import quant_linear as ql  # noqa: E402

# (name, N, K, format): fused q|k|v, o, fused gate|up, down, the tied head
SHAPES = {
    "qkv": (960, 576, "q4_1"), "o": (576, 576, "q4_1"), "gate_up": (3072, 576, "q4_1"), "down": (576, 1536, "q4_1"),
    "head": (49152, 576, "q8_0"),
    # Gemma 3 270M's Q5_0 layers (fused q|k|v where all three are Q5_0, gate|up) and its tied Q8_0 head (178 MB:
    # larger than the caches, so it runs at the memory bandwidth at 1 row)
    "g_qkv": (1536, 640, "q5_0"), "g_gate_up": (4096, 640, "q5_0"), "g_head": (262144, 640, "q8_0"),
    # and its Q6_K down projections (8-bit records of quants below 64)
    "g_down": (640, 2048, "q6_k"),
}
FORMATS = {"q4_1": ql.QuantFormat(4, 32, "float16", True), "q8_0": ql.QuantFormat(8, 32, "float16", False, c=-128),
           "q5_0": ql.QuantFormat(5, 32, "float16", False, c=-16),
           "q6_k": ql.QuantFormat(8, 16, "float32", False, c=-32)}
VALUE_BITS = {"q6_k": 6}  # quants below 2^this (default: the format's bits)


def variant_module(spec: str, index: int):
    """'DI_ROW_CHUNK=128,...' (-D flags) and/or 'src=DIR' (another copy of csrc/), ';'-separated parts of --variants."""
    flags, csrc = list(cpu_ops.ISA_FLAGS["native"]), None
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part.startswith("src="):
            csrc = part[4:]
        else:
            flags.append(f"-D{part}")
    tag = "".join(c if c.isalnum() else "_" for c in spec) or "default"
    name = f"deepinfer_qlrows_{index}_{tag}"[:80]
    return cpu_ops.build(name, flags, csrc)


def random_weight(n: int, k: int, fmt: ql.QuantFormat, rng: np.random.Generator, value_bits: int) -> ql.PackedWeight:
    u = rng.integers(0, 1 << value_bits, size=(n, k), dtype=np.uint8)
    scales = (rng.random((n, k // fmt.group), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
    offsets = (rng.standard_normal((n, k // fmt.group), dtype=np.float32) * 0.01).astype(np.float16).astype(
        np.float32) if fmt.affine else None
    return ql.pack(ql.Canonical(fmt, u, scales, offsets))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="DI_ROW_CHUNK=1000000;", help="';'-separated; the first is the baseline")
    parser.add_argument("--rows", default="1,8,64,2048", help="activation rows, comma-separated")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,head")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/quant_linear_rows.json")
    parser.add_argument("--other-bits", action="store_true",
                        help="variants may round differently (an arithmetic change): print each one's largest "
                             "difference from the first, relative to the largest output, instead of refusing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    specs = args.variants.split(";")
    modules = [variant_module(spec, i) for i, spec in enumerate(specs)]
    rng = np.random.default_rng(0)
    results = []
    for shape in args.shapes.split(","):
        n, k, fmt = SHAPES[shape]
        weight = random_weight(n, k, FORMATS[fmt], rng, VALUE_BITS.get(fmt, FORMATS[fmt].bits))
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            want = ql.linear(modules[0], x, weight)
            diffs = []
            for mod, spec in zip(modules[1:], specs[1:]):
                got = ql.linear(mod, x, weight)
                assert args.other_bits or torch.equal(got, want), f"variant {spec!r} changed the bits ({shape}, {m})"
                diffs.append(float((got - want).abs().max() / want.abs().max()))
            reps = max(1, int(2e8 / (m * n * k)))
            times = [[] for _ in modules]
            for r in range(args.repeats):
                order = range(len(modules)) if r % 2 == 0 else reversed(range(len(modules)))
                for i in order:
                    start = time.perf_counter()
                    for _ in range(reps):
                        ql.linear(modules[i], x, weight)
                    times[i].append((time.perf_counter() - start) / reps)
            medians = [statistics.median(t) for t in times]
            row = {"shape": shape, "n": n, "k": k, "format": fmt, "rows": m,
                   "ms": {spec or "default": med * 1e3 for spec, med in zip(specs, medians)},
                   "ratio_to_first": [medians[0] / med for med in medians],
                   "gmac_per_s_per_thread": [m * n * k / med / 1e9 / args.threads for med in medians],
                   "max_relative_difference": diffs}
            results.append(row)
            print(f"{shape:8s} {n}x{k} {fmt} rows {m:5d}: " + "  ".join(
                f"{spec or 'default'} {med * 1e3:.3f} ms ({medians[0] / med:.3f}x)" for spec, med in zip(specs, medians))
                + ("  max diff " + ", ".join(f"{d:.1e}" for d in diffs) if args.other_bits else ""), flush=True)
    totals = {spec or "default": sum(r["ms"][spec or "default"] for r in results) for spec in specs}
    print("total ms:", {s: round(v, 2) for s, v in totals.items()})
    write_json({"machine": machine_info(args.threads), "variants": specs, "results": results, "total_ms": totals},
               args.out)


if __name__ == "__main__":
    main()
