"""The batch-invariant transform: swaps a built model's linear layers and norms for fixed-order kernels
(ops/batch_invariant.py). Attention switches itself through the forward context."""
from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.layers.mla import MLAttention
from deepinfer.layers.moe import MoE
from deepinfer.layers.norm import RMSNorm
from deepinfer.ops.batch_invariant import ROW_TILE, linear, pack_panels, pack_weight, rms_norm, short_tiles

logger = logging.getLogger(__name__)


class InvariantLinear(nn.Module):
    """A Linear / nn.Linear that computes through the compiled fma-chain kernel (float32 weights, compiled CPU ops)
    or ``linear``'s fixed tiles; shares the original parameters (ties stay tied)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, probed: dict[tuple, tuple[int, ...]],
                 ops: ModuleType | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.ops = ops if ops is not None and weight.dtype == torch.float32 and weight.device.type == "cpu" else None
        # not buffers: layouts rebuilt from the weight (the kernel's panels, or MKL's packed tile)
        self.panels = pack_panels(weight) if self.ops is not None else None
        self.packed = pack_weight(weight) if self.ops is None else None
        key = (tuple(weight.shape), weight.dtype, bias is not None)  # MKL picks its kernels by shape, not values
        if self.ops is None and key not in probed:
            probed[key] = short_tiles(weight, bias, self.packed)
        self.short = probed.get(key, ())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            return linear(x, self.weight, self.bias, self.packed, self.short)
        n = self.weight.shape[0]
        out = self.ops.dense_linear(x.reshape(-1, x.shape[-1]), self.panels, n, self.bias)
        return out.reshape(*x.shape[:-1], n)


class InvariantRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.offset = norm.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def make_batch_invariant(model: nn.Module, ops: ModuleType | None = None, norms: bool = True) -> nn.Module:
    """Swaps every Linear, nn.Linear (lm_head included) and RMSNorm of a built model for its invariant form, in
    place. Model files stay unchanged. With the compiled CPU ops (`ops`), float32 linear layers run on their
    fma-chain kernel; otherwise on fixed-height GEMM tiles. norms=False leaves RMSNorm as it is, for the caller to
    point at the compiled row norm (transforms/fused_ops.py), which is invariant as it stands.

    Raises ValueError for layers whose reductions have no invariant form yet (MLA, MoE routing and combine).
    """
    unsupported = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (MLAttention, MoE))})
    if unsupported:
        raise ValueError(f"batch_invariant is not supported for {type(model).__name__}: its {', '.join(unsupported)} "
                         f"layers have no batch-invariant kernels; supported are dense attention models")
    probed = {}  # short tile heights per weight shape, probed once for this model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (Linear, nn.Linear)):
                setattr(parent, name, InvariantLinear(child.weight, child.bias, probed, ops))
            elif norms and isinstance(child, RMSNorm):
                setattr(parent, name, InvariantRMSNorm(child))
    chains = sum(isinstance(m, InvariantLinear) and m.ops is not None for m in model.modules())
    if chains:
        logger.info("batch invariant: %d float32 linear layers on the compiled fma-chain kernel (%s): one chain in "
                    "k order per output, any row count", chains, ops.isa())
    if probed:
        shown = "; ".join(f"{shape[0]}x{shape[1]}: {', '.join(map(str, short)) or 'none'}"
                          for (shape, _, _), short in probed.items())
        logger.info("batch invariant: linear layers in %d-row GEMM tiles; shorter last tiles whose rows probed "
                    "bitwise equal per weight shape: %s", ROW_TILE, shown)
    return model
