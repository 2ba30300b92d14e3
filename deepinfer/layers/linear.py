"""Linear layers that know how to load their own (possibly stacked) weights."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b, with W the concatenation of output shards (e.g. q|k|v or gate|up).

    Fusing shards turns several small matmuls into one, which matters on a CPU.
    """

    def __init__(self, in_features: int, out_shards: list[int] | int, bias: bool = False,
                 quantizable: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.quantizable = quantizable  # False: the owner reads the weight as a matrix (MLA's absorbed kv_b_proj)
        self.shards = [out_shards] if isinstance(out_shards, int) else list(out_shards)
        out = sum(self.shards)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def checkpoint_loaders(self, prefix: str, shard_name: Callable[[str, int, int], str]) -> dict[str, Callable]:
        """Checkpoint name of each shard of the weight (and bias) -> its loader."""
        dot = f"{prefix}." if prefix else ""
        leaves = ["weight"] + (["bias"] if self.bias is not None else [])
        return {shard_name(dot + leaf, i, len(self.shards)): (lambda t, leaf=leaf, i=i: self.load_shard(leaf, t, i))
                for leaf in leaves for i in range(len(self.shards))}

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
