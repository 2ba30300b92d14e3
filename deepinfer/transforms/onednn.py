"""bfloat16 linear layers with weights pre-packed for oneDNN, on CPUs that compute bfloat16 natively.

Plain bfloat16 F.linear repacks its weight on every call; packing once at load is what makes bfloat16 fast on a
CPU (one SmolLM2 decode step's linear layers, one thread: 17 ms plain, 9 ms packed, 30 ms in float32;
../shared/research/cpu-matmul.md). Packed and plain calls give the same values.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.linear import Linear

logger = logging.getLogger("deepinfer")

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class PackedLinear(nn.Module):
    """A Linear / nn.Linear whose bfloat16 weight oneDNN packed once; shares the original parameters."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.bfloat16 or rows.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*lead, out.shape[-1])


def native_bf16(cpu_flags: set[str]) -> bool:
    return any(flag in cpu_flags for flag in NATIVE_BF16_FLAGS)


def prepack_bf16_linears(model: nn.Module) -> int:
    """Swaps every bfloat16 Linear / nn.Linear for a PackedLinear, in place; returns how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (Linear, nn.Linear)) and child.weight.dtype == torch.bfloat16 \
                    and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                swapped += 1
    return swapped
