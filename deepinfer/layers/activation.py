"""Gated activations of SwiGLU / GeGLU MLPs: [T, 2I] (gate | up) -> act(gate) * up."""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

ACTS = {"silu": 0, "gelu_tanh": 1}  # codes of the fused op (ops/csrc/layer_ops.cpp: act_and_mul)


class ActAndMul(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        if act not in ACTS:
            raise ValueError(f"activation must be one of {sorted(ACTS)}, got {act!r}")
        self.act = act
        self.ops: ModuleType | None = None  # fused CPU op (transforms/fused_ops.py); None: torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.ops.act_and_mul(x, ACTS[self.act])
        gate, up = x.chunk(2, dim=-1)
        return (F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")) * up
