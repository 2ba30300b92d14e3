"""Rotary position embeddings; frequencies come from transformers' RoPE parameter functions,
so every scaling type a config names (linear, llama3, yarn, ...) matches the reference exactly."""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


def rope_frequencies(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], attention scaling) for a config, optionally per layer type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in ("dynamic", "longrope"):
        raise ValueError(f"unsupported rope type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, Hkv, D] at the given positions (rotate-half layout)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, interleaved: bool = False) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.int64).float()  # on the device being built for
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)
        self.rotary_dim = inv_freq.numel() * 2
        self.interleaved = interleaved
        self.ops: ModuleType | None = None  # fused CPU op, in place (transforms/fused_ops.py); None: torch ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None and not self.interleaved and q.dtype == k.dtype == torch.float32 \
                and _heads_contiguous(q) and _heads_contiguous(k):
            self.ops.rotary_(q, k, positions, self.cos, self.sin)  # the same products and sums, rounded alike
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleaved:  # pairs (0,1), (2,3), ...: regroup to the half layout first
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half].float(), rot[..., half:].float()
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
