"""Decode attention's software prefetch: how far ahead and into which cache level, measured on the compiled kernel.

Builds the compiled ops once per variant (`-DDI_ATTN_AHEAD=blocks -DDI_ATTN_LOC=locality`, see attention.cpp, or
`src=DIR`: another copy of csrc/, an older commit's, to compare a change; every variant must give the first one's
bits, checked) and
times `paged_decode` on SmolLM2's attention shapes (9 query heads, 3 KV heads, head dim 64, bfloat16 cache,
16-token blocks scattered over the pool) over 8 layers' caches, so that at batch sizes of 64 and more the cache comes
from memory as in a real step. The variants take turns; medians of --repeats; ratios against the first variant.

    python benchmarks/attention_prefetch.py                                  # 1,3 (L1) against 1,2 (L2), and more
    python benchmarks/attention_prefetch.py --variants "1,3;1,2" --shapes "64x330,128x330"
    git archive 65f5a93 deepinfer/ops/csrc | tar -x -C /tmp/old
    python benchmarks/attention_prefetch.py --variants "src=/tmp/old/deepinfer/ops/csrc;1,3"   # that commit vs now
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


def build(variant: str, index: int):
    """'ahead,locality' (-D flags on these sources) or 'src=DIR' (another copy of csrc/, its own defaults)."""
    if variant.startswith("src="):
        return cpu_ops.build(f"deepinfer_attn_pf_src{index}", list(cpu_ops.ISA_FLAGS["native"]), variant[4:])
    ahead, locality = (int(x) for x in variant.split(","))
    return cpu_ops.build(f"deepinfer_attn_pf_{ahead}_{locality}", [*cpu_ops.ISA_FLAGS["native"],
                         f"-DDI_ATTN_AHEAD={ahead}", f"-DDI_ATTN_LOC={locality}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="1,3;1,2;2,2;1,1",
                        help="ahead,locality or src=DIR, ';'-separated (first: the baseline)")
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
        outs = [ops.paged_decode(q, ks[0], vs[0], tables, lens, bs, dim ** -0.5, 0) for ops in modules.values()]
        if not all(torch.equal(outs[0], o) for o in outs[1:]):
            sys.exit(f"{shape}: the variants' outputs differ")
        times = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v, ops in modules.items():
                start = time.perf_counter()
                for k, val in zip(ks, vs):
                    ops.paged_decode(q, k, val, tables, lens, bs, dim ** -0.5, 0)
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
