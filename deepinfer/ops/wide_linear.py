"""Prompt rows in bfloat16 on AMX tiles (csrc/amx_linear.cpp): activations rounded to bfloat16, the quantized weight
dequantized from its blocks to bfloat16 tiles as the kernel goes (no copy kept), products summed in float32 in K
order.

On a CPU with AMX, a prompt's matmuls are compute-bound and the tiles, dequantization included, multiply 1.5-2.6x
faster than our int8 dot products on the quantized blocks at 64-512 rows (slower at 16: each call dequantizes the
whole weight; doc/inference_deployment_qa.md, "Prompts in bfloat16 on AMX"). A weight's
bfloat16 values are its blocks' dequantized values (Canonical.dequantize: scale * u + offset in float32) rounded to
nearest even. Each row's outputs are the same instructions in the same order however many rows the call has, so a
prompt's KV does not depend on how it was chunked or batched; oneDNN's bfloat16 matmul (the other way to reach the
tiles from torch) splits K by the row count, and its rows change bits with the batch (measured:
doc/inference_deployment_qa.md, "Prompts in bfloat16 on AMX").
"""
from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.ops.quant_linear import PackedWeight


def available(kernels: ModuleType | None) -> bool:
    """Whether these compiled ops can compute on AMX-BF16 tiles here (built for a CPU with them, and the OS
    granted this process the tile state)."""
    return kernels is not None and hasattr(kernels, "amx_linear") and bool(kernels.amx_bf16_available())


def linear(kernels: ModuleType, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32."""
    if x.dim() != 2 or x.shape[-1] != w.k:
        raise ValueError(f"wide linear takes [M, {w.k}] inputs, got {tuple(x.shape)}")
    return kernels.amx_linear(x.contiguous(), *w.op_args, bias)
