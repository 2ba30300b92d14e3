"""Prompt rows in bfloat16 on AMX tiles (csrc/amx_linear.cpp): a quantized weight widened once to bfloat16 and
packed in the tile layout, activations rounded to bfloat16, products summed in float32 in K order.

On a CPU with AMX, a prompt's matmuls are compute-bound and the tiles multiply bfloat16 ~2x faster than our int8
dot products on the quantized blocks (doc/inference_deployment_qa.md, "Prompts in bfloat16 on AMX"). The copy
costs 16 bits per weight besides the blocks. Each row's outputs are the same instructions in the same order however
many rows the call has, so a prompt's KV does not depend on how it was chunked or batched; oneDNN's bfloat16
matmul (the other way to reach the tiles from torch) splits K by the row count, and its rows change bits with the
batch (measured: doc/inference_deployment_qa.md, "Prompts in bfloat16 on AMX").
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

TILE_COLS = 16  # output columns per tile
TILE_K = 32  # bfloat16 values of K per tile row pair set


@dataclass(frozen=True)
class WideWeight:
    n: int
    k: int
    packed: torch.Tensor  # bfloat16 [n_pad / 16, k / 32, 16, 32]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def available(kernels: ModuleType | None) -> bool:
    """Whether these compiled ops can compute on AMX-BF16 tiles here (built for a CPU with them, and the OS
    granted this process the tile state)."""
    return kernels is not None and hasattr(kernels, "amx_linear") and bool(kernels.amx_bf16_available())


def pack(w: torch.Tensor) -> WideWeight:
    """float32 [N, K] -> bfloat16 (nearest even) in tiles: tile (n-block, k-chunk) row r holds the pair
    (k = 2r, 2r + 1) of each of its 16 columns; N padded with zero rows to a multiple of 16."""
    n, k = w.shape
    if k % TILE_K:
        raise ValueError(f"a wide weight needs K a multiple of {TILE_K}, got K={k}")
    n_pad = -(-n // TILE_COLS) * TILE_COLS
    wide = torch.zeros(n_pad, k, dtype=torch.bfloat16)
    wide[:n] = w.to(torch.bfloat16)
    tiles = wide.view(n_pad // TILE_COLS, TILE_COLS, k // TILE_K, TILE_K // 2, 2).permute(0, 2, 3, 1, 4)
    return WideWeight(n, k, tiles.contiguous().view(n_pad // TILE_COLS, k // TILE_K, 16, 32))


def dequantize(w: WideWeight) -> torch.Tensor:
    """The bfloat16 weight as float32 [N, K] (what the tiles multiply with)."""
    nb, kc = w.packed.shape[:2]
    rows = w.packed.view(nb, kc, 16, TILE_COLS, 2).permute(0, 3, 1, 2, 4).reshape(nb * TILE_COLS, w.k)
    return rows[: w.n].float()


def linear(kernels: ModuleType, x: torch.Tensor, w: WideWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32."""
    if x.dim() != 2 or x.shape[-1] != w.k:
        raise ValueError(f"wide linear takes [M, {w.k}] inputs, got {tuple(x.shape)}")
    return kernels.amx_linear(x.contiguous(), w.packed, w.n, bias)
