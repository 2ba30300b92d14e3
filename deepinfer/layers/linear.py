"""Linear layers that know how to load their own (possibly stacked) weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b, with W the concatenation of output shards (e.g. q|k|v or gate|up).

    Fusing shards turns several small matmuls into one, which matters on a CPU.
    """

    def __init__(self, in_features: int, out_shards: list[int] | int, bias: bool = False) -> None:
        super().__init__()
        self.shards = [out_shards] if isinstance(out_shards, int) else list(out_shards)
        out = sum(self.shards)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        start = sum(self.shards[:shard])
        rows = self.shards[shard]
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} for a layer built without one")
        expected = (rows,) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape mismatch for {name} shard {shard}: checkpoint {tuple(tensor.shape)}, expected {expected}")
        target.data[start : start + rows].copy_(tensor)
