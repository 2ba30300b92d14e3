from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, or * (1 + w) for Gemma's offset form; computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.ops: ModuleType | None = None  # fused CPU op (transforms/fused_ops.py); None: torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dtype == torch.float32 == self.weight.dtype:
            rows = x.reshape(-1, x.shape[-1])
            return self.ops.rms_norm(rows, self.weight, self.eps, self.offset).view(x.shape)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (self.weight.float() + self.offset)).to(dtype)
