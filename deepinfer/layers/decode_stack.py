"""The decode fast path of a Llama-family model on quantized weights: every decoder layer of a decode-only step
(decode rows: one token per sequence, or a token and its drafts, each a row of its own) in one call to the
compiled ops (csrc/decode_stack.cpp). It runs the row and block code the module path runs, in the same order, so a
row gets the same bits either way; what it removes is Python between the ops and a thread fork per op (about two
thirds of a batch-1 decode step's time outside the matrix products). Steps with prefill chunks, and the
batch-invariant mode, take the module path.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from deepinfer.layers.activation import ACTS
from deepinfer.layers.context import get_forward_context

CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _linear_args(linear: nn.Module) -> tuple:
    packed = linear.weight.packed
    bias = linear.bias.detach() if linear.bias is not None else None
    return (*packed.op_args, bias)


class DecodeStack:
    """Built from a model's decoder layers (each: norm1, qkv, rotary, attention, o, norm2, gate_up, act, down, as
    plain modules and parameters) and its final norm; the compiled stack is made on the first step that uses it
    and again whenever the KV cache tensors change."""

    def __init__(self, ops: ModuleType, layers: list[dict[str, Any]], final_norm: nn.Module,
                 shape: tuple[int, int, int], scale: float, act: str, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.ops = ops
        self.cache_index = [layer["attn"].cache_index for layer in layers]
        self.windows = [layer["attn"].sliding_window or -1 for layer in layers]
        self.linears = [_linear_args(layer[name]) for layer in layers for name in ("qkv", "o", "gate_up", "down")]
        norms = [n for layer in layers for n in (layer["norm1"], layer["norm2"])] + [final_norm]
        self.norms = [n.weight.detach() for n in norms]
        self.eps = [float(n.eps) for n in norms]
        self.shape, self.scale, self.act = list(shape), float(scale), ACTS[act]
        self.cos, self.sin = cos, sin
        self._caches: list | None = None
        self._stack = None

    def _compiled(self, kv_caches: list) -> Any:
        if self._caches is not kv_caches:
            caches = [kv_caches[i] for i in self.cache_index]
            self._stack = self.ops.DecodeStack(self.linears, self.norms, self.eps, self.windows, self.shape,
                                               self.scale, self.act, self.cos, self.sin,
                                               [k for k, _ in caches], [v for _, v in caches])
            self._caches = kv_caches
        return self._stack

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of a decode-only step, or None where the module path must run."""
        ctx = get_forward_context()
        md = ctx.attn
        if ctx.batch_invariant or ctx.layer_attn is not None or ctx.cpu_kernels is None or md.prefills \
                or x.dim() != 2 or md.num_decodes != x.shape[0] or x.dtype != torch.float32:
            return None
        k_cache, v_cache = ctx.kv_caches[self.cache_index[0]]
        if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
            return None
        return self._compiled(ctx.kv_caches).forward(x, positions, md.slot_mapping, md.decode_block_tables,
                                                     md.decode_context_lens, md.block_size)
