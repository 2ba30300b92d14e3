"""Prompt-row linear kernels side by side on one model's linear shapes: our int4 kernel on the quantized blocks,
oneDNN's bfloat16 matmul on pre-packed weights (what torch reaches AMX with; its bfloat16 output widened back to
float32, as the model needs) and our AMX tile kernel (ops/wide_linear.py: the same int4 blocks dequantized to
bfloat16 tiles as it goes). Medians of --repeats calls per shape and
row count, the same inputs for all three; then, per kernel, whether a row's outputs keep their bits when the same
row is computed inside batches of other sizes (the property chunked prefill and batching need).

    python benchmarks/amx_linear.py                      # SmolLM2's four shapes, 16 / 64 / 128 / 512 rows
    python benchmarks/amx_linear.py --shapes gemma3-270m

Needs a CPU with AMX-BF16 for the tile kernel (the others run anywhere).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, median_seconds, write_json  # noqa: E402

SHAPES = {  # name -> {layer: (N, K)}
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "gemma3-270m": {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048)},
}
INVARIANCE_ROWS = (1, 3, 16, 17, 32, 64, 96, 128, 255, 256, 300, 512)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="16,64,128,512")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from deepinfer.ops import cpu_ops
    from deepinfer.ops import quant_linear as ql
    from deepinfer.ops import wide_linear as wl

    torch.set_num_threads(args.threads)
    kernels = cpu_ops.load()
    if not wl.available(kernels):
        sys.exit("this CPU has no AMX-BF16 (or the OS refused AMX tile state): the tile kernel cannot run here")
    torch.manual_seed(0)
    layers = {}
    for name, (n, k) in SHAPES[args.shapes].items():
        w = torch.randn(n, k) * 0.05
        q = ql.pack(ql.quantize_int4(w.numpy()))
        layers[name] = (q, torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1), k)
    kinds = {
        "int4 blocks": lambda x, q, d: ql.linear(kernels, x, q),
        "oneDNN bfloat16": lambda x, q, d: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), d, None, "none", [],
                                                                               "").float(),
        "AMX tiles": lambda x, q, d: wl.linear(kernels, x, q),
    }
    points = []
    for m in [int(r) for r in args.rows.split(",")]:
        totals = dict.fromkeys(kinds, 0.0)
        for name, (q, d, k) in layers.items():
            x = torch.randn(m, k)
            for kind, fn in kinds.items():
                ms = median_seconds(lambda: fn(x, q, d), args.repeats) * 1e3
                totals[kind] += ms
                points.append({"rows": m, "layer": name, "kernel": kind, "ms": ms})
        ratios = ", ".join(f"{kind} {totals[kind]:.3f} ms" for kind in kinds)
        tiles = totals["AMX tiles"]
        print(f"{m:4d} rows, all {len(layers)} layers: {ratios}; tiles vs int4 {totals['int4 blocks'] / tiles:.2f}x, "
              f"vs oneDNN {totals['oneDNN bfloat16'] / tiles:.2f}x", flush=True)
    invariance = {}
    for kind, fn in kinds.items():  # row `start` .. of a 700-row batch, alone in a batch of m rows
        changed = []
        for name, (q, d, k) in layers.items():
            x = torch.randn(700, k)
            whole = fn(x, q, d)
            for m in INVARIANCE_ROWS:
                for start in (0, 3, 700 - m):
                    if not torch.equal(fn(x[start : start + m].contiguous(), q, d), whole[start : start + m]):
                        changed.append(f"{name}@{m}")
        invariance[kind] = sorted(set(changed))
        print(f"{kind}: rows keep their bits across batch sizes {INVARIANCE_ROWS}: "
              f"{'yes' if not changed else 'no, at ' + ', '.join(sorted(set(changed)))}")
    out = args.out or default_output_path("amx_linear")
    write_json({"benchmark": "amx_linear", "shapes": args.shapes, "threads": args.threads,
                "machine": machine_info(args.threads), "points": points, "bits_change_with_batch": invariance}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
