"""Prompt rows' attention (`paged_prefill`: each query over its own causal context in the paged cache) side by side
across builds of the compiled ops: the current one, another copy of csrc/ (an older commit's) or the current one
with -D flags (`DI_ATTN_TILE=2`: query tiles of 2 rows). One causal prompt per shape over a shuffled paged
bfloat16 cache (or --kv-dtype); the variants take turns, medians of --repeats calls; every variant must give the
first one's bits (checked), ratios against the first.

    git archive HEAD deepinfer/ops/csrc | tar -x -C /tmp/old
    python benchmarks/prompt_attention.py --variants "src=/tmp/old/deepinfer/ops/csrc;" --tokens 512,2048
    python benchmarks/prompt_attention.py --variants ";DI_ATTN_TILE=2;DI_ATTN_TILE=8"
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_output_path, machine_info, write_json  # noqa: E402

from deepinfer.ops import cpu_ops  # noqa: E402

# name -> (query heads, KV heads, head dim, sliding window or -1)
SHAPES = {"smollm2": (9, 3, 64, -1), "gemma3-sliding": (4, 1, 256, 512), "gemma3-full": (4, 1, 256, -1)}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}


def build(variant: str, index: int):
    """The ops for a variant: '' the current build, 'src=DIR' that copy of csrc/, 'NAME=VALUE,...' -D flags."""
    if variant == "":
        return cpu_ops.load()
    flags = list(cpu_ops.ISA_FLAGS["native"])
    if variant.startswith("src="):
        return cpu_ops.build(f"deepinfer_prompt_attn_src{index}", flags, variant[4:])
    defines = [f"-D{d}" for d in variant.split(",") if d]
    tag = "".join(c for c in variant if c.isalnum())
    return cpu_ops.build(f"deepinfer_prompt_attn_{tag}", flags + defines)


def inputs(shape: tuple[int, int, int, int], tokens: int, dtype: torch.dtype, block_size: int = 16):
    """q [tokens, heads, dim], a shuffled paged cache holding the prompt's K and V, its block table."""
    heads, kv_heads, dim, _ = shape
    gen = torch.Generator().manual_seed(tokens + dim)
    blocks = (tokens + block_size - 1) // block_size
    pool = 2 * blocks + 8  # the prompt's blocks scattered over a pool twice its size
    table = torch.randperm(pool, generator=gen)[:blocks]
    k = torch.randn(pool * block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pool * block_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(tokens, heads, dim, generator=gen)
    return q, k, v, table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", required=True, help="';'-separated variants (see above)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--kv-dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = args.variants.split(";")
    if len(variants) < 2:
        parser.error("give at least two variants, ';'-separated")
    ops = [build(v, i) for i, v in enumerate(variants)]
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        scale = shape[2] ** -0.5
        for tokens in (int(t) for t in args.tokens.split(",")):
            q, k, v, table = inputs(shape, tokens, DTYPES[args.kv_dtype])
            call = [lambda m=m: m.paged_prefill(q, k, v, table, 0, 16, scale, shape[3], 0) for m in ops]
            first = call[0]()
            for variant, c in zip(variants, call):
                if not torch.equal(c(), first):
                    raise SystemExit(f"{variant!r} gives other bits than {variants[0]!r} on {name} x {tokens}")
            times: list[list[float]] = [[] for _ in ops]
            for _ in range(args.repeats):  # the variants take turns
                for i, c in enumerate(call):
                    start = time.perf_counter()
                    c()
                    times[i].append(time.perf_counter() - start)
            ms = [1000 * statistics.median(t) for t in times]
            rows.append({"shape": name, "tokens": tokens, "ms": dict(zip(variants, ms)),
                         "speedup": {v: ms[0] / m for v, m in zip(variants, ms)}})
            print(f"{name:15s} {tokens:5d} tokens: " + "  ".join(
                f"{v or 'current'}: {m:8.2f} ms ({ms[0] / m:.2f}x)" for v, m in zip(variants, ms)), flush=True)
    out = args.out or default_output_path("prompt_attention")
    write_json({"machine": machine_info(args.threads), "threads": args.threads, "kv_dtype": args.kv_dtype,
                "variants": variants, "rows": rows}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
