"""Prompt rows' attention side by side: the per-query paged kernel (`paged_prefill`, float32 arithmetic over the
bfloat16 cache: what prompt rows took before stop 62 and what other rows take) against the AMX tile kernel
(`amx_attention`, csrc/amx_attention.cpp: queries and probabilities rounded to bfloat16). One causal prompt over a
shuffled paged cache per shape; medians of --repeats calls, the same inputs for both; the largest difference
between the two, relative to the values' largest magnitude.

    python benchmarks/amx_attention.py                    # SmolLM2's and Gemma 3's attention shapes

Needs a CPU with AMX-BF16.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, median_seconds, write_json  # noqa: E402

# name -> (query heads, KV heads, head dim, sliding window or -1)
SHAPES = {"smollm2": (9, 3, 64, -1), "gemma3-sliding": (4, 1, 256, 512), "gemma3-full": (4, 1, 256, -1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="128,512,2048")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from deepinfer.ops import cpu_ops
    from deepinfer.ops import wide_linear as wl

    torch.set_num_threads(args.threads)
    ops = cpu_ops.load()
    if not wl.available(ops):
        sys.exit("this CPU has no AMX-BF16 (or the OS refused AMX tile state): the tile kernel cannot run here")
    results = []
    for name in args.shapes.split(","):
        heads, kv_heads, dim, window = SHAPES[name]
        for tokens in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator().manual_seed(tokens)
            blocks = (tokens + 15) // 16
            table = torch.randperm(blocks + 8, generator=g)[:blocks]
            k = torch.randn((blocks + 8) * 16, kv_heads, dim, generator=g).bfloat16()
            v = torch.randn((blocks + 8) * 16, kv_heads, dim, generator=g).bfloat16()
            q = torch.randn(tokens, heads, dim, generator=g)
            scale = dim ** -0.5
            paged = lambda: ops.paged_prefill(q, k, v, table, 0, 16, scale, window, 0)  # noqa: E731
            tiles = lambda: ops.amx_attention(q, k, v, table, 0, 16, scale, window)  # noqa: E731
            diff = (paged() - tiles()).abs().max().item() / v.float().abs().max().item()
            t_paged, t_tiles = median_seconds(paged, args.repeats), median_seconds(tiles, args.repeats)
            row = {"shape": name, "tokens": tokens, "paged_ms": t_paged * 1e3, "tiles_ms": t_tiles * 1e3,
                   "speedup": t_paged / t_tiles, "max_rel_diff": diff}
            results.append(row)
            print(f"{name:15s} {tokens:5d} tokens: paged {row['paged_ms']:7.3f} ms  tiles {row['tiles_ms']:7.3f} ms"
                  f"  {row['speedup']:.2f}x  max |diff| / max |v| {diff:.1e}")
    path = write_json({"benchmark": "amx_attention", "machine": machine_info(args.threads), "results": results},
                      args.out or default_output_path("amx_attention"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
