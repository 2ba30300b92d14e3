"""Decode attention's software prefetch: how far ahead and into which cache level, measured on the compiled kernel.

A variant is `l1` / `l2` (the current build, prefetching into that level: the `prefetch` argument of paged_decode),
`machine` (the level this machine's rule picks, csrc/prefetch_level.h), `ahead,locality` (a build with
`-DDI_ATTN_AHEAD=blocks`, prefetching into L1 for locality 3, L2 for 2) or `src=DIR` (another copy of csrc/, an
older commit's, to compare a change); every variant must give the first one's bits (checked), and
times `paged_decode` on SmolLM2's attention shapes (9 query heads, 3 KV heads, head dim 64, bfloat16 cache,
16-token blocks scattered over the pool) over 8 layers' caches, so that at batch sizes of 64 and more the cache comes
from memory as in a real step. The variants take turns; medians of --repeats; ratios against the first variant.

    python benchmarks/attention_prefetch.py                                  # the machine's level, L1, L2, 2 ahead
    python benchmarks/attention_prefetch.py --variants "l1;l2" --shapes "64x330,128x330"
    git archive 65f5a93 deepinfer/ops/csrc | tar -x -C /tmp/old
    python benchmarks/attention_prefetch.py --variants "src=/tmp/old/deepinfer/ops/csrc;machine"  # that commit vs now
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, write_json  # noqa: E402

from deepinfer.ops import cpu_ops  # noqa: E402


LEVELS = {"machine": 0, "l1": 3, "l2": 2}  # paged_decode's prefetch argument


def build(variant: str, index: int):
    """A function (q, k, v, tables, lens, block_size, scale) -> paged_decode's output, for the variant."""
    if variant.startswith("src="):  # another copy of csrc/, with its own defaults (older ones take no prefetch)
        ops = cpu_ops.build(f"deepinfer_attn_pf_src{index}", list(cpu_ops.ISA_FLAGS["native"]), variant[4:])
        return lambda *a: ops.paged_decode(*a, 0)
    if variant in LEVELS:
        ops, level = cpu_ops.load(), LEVELS[variant]
    else:
        ahead, level = (int(x) for x in variant.split(","))
        ops = cpu_ops.build(f"deepinfer_attn_pf_{ahead}", [*cpu_ops.ISA_FLAGS["native"], f"-DDI_ATTN_AHEAD={ahead}"])
    return lambda *a: ops.paged_decode(*a, 0, prefetch=level)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="machine;l1;l2;2,2",
                        help="machine, l1, l2, ahead,locality or src=DIR, ';'-separated (first: the baseline)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--shapes", default="1x2000,16x330,64x330,128x330,32x600", help="rows x context tokens, ...")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/attention_prefetch.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    modules = {v: build(v, i) for i, v in enumerate(variants)}
    print(f"this machine prefetches into {cpu_ops.load().attention_prefetch()}", flush=True)
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    results = []
    for shape in args.shapes.split(","):
        rows, ctx = (int(x) for x in shape.split("x"))
        width = -(-ctx // bs)
        blocks = rows * width + 8
        ks = [torch.randn(blocks * bs, kv_heads, dim).to(torch.bfloat16) for _ in range(args.layers)]
        vs = [torch.randn_like(k) for k in ks]
        tables = torch.randperm(blocks)[: rows * width].view(rows, width).contiguous().long()
        lens, q = torch.full((rows,), ctx, dtype=torch.long), torch.randn(rows, heads, dim)
        outs = [run(q, ks[0], vs[0], tables, lens, bs, dim ** -0.5) for run in modules.values()]
        if not all(torch.equal(outs[0], o) for o in outs[1:]):
            sys.exit(f"{shape}: the variants' outputs differ")
        times = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v, run in modules.items():
                start = time.perf_counter()
                for k, val in zip(ks, vs):
                    run(q, k, val, tables, lens, bs, dim ** -0.5)
                times[v].append((time.perf_counter() - start) / args.layers)
        medians = {v: statistics.median(t) for v, t in times.items()}
        base = medians[variants[0]]
        row = {"rows": rows, "context": ctx, "ms_per_layer": {v: m * 1e3 for v, m in medians.items()},
               "speedup": {v: base / m for v, m in medians.items()}}
        results.append(row)
        print(f"{rows:4d} rows x {ctx:5d} tokens: " + "  ".join(
            f"{v}: {m * 1e3:.3f} ms ({base / m:.2f}x)" for v, m in medians.items()), flush=True)
    write_json({"machine": machine_info(torch.get_num_threads()), "results": results}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
