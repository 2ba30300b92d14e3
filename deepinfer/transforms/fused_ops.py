"""The fused-glue transform: norms, gated activations, rotary embeddings and KV cache writes of a built model
compute through the compiled CPU ops (ops/csrc/layer_ops.cpp), one call each instead of several torch ops.

Rotary and the cache write give the same bits as the torch ops they replace. The norm and the activation round
differently (a fixed per-row order, C exp / tanh), so the batch-invariant mode, whose reproducibility promise is
tied to its own kernels, takes only the bit-exact two.
"""
from __future__ import annotations

from types import ModuleType

from torch import nn

from deepinfer.layers.activation import ActAndMul
from deepinfer.layers.attention import Attention
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding


def enable_fused_ops(model: nn.Module, ops: ModuleType, exact_only: bool = False) -> int:
    """Points every supported layer at `ops`, in place; returns how many layers changed."""
    kinds = (RotaryEmbedding, Attention) if exact_only else (RotaryEmbedding, Attention, RMSNorm, ActAndMul)
    changed = 0
    for module in model.modules():
        if type(module) in kinds:
            module.ops = ops
            changed += 1
    return changed
