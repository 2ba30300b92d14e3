"""The fast path of a Llama-family or Gemma 3 model on quantized weights: every decoder layer of a step in one call to
the compiled ops (csrc/decode_stack.cpp). Rows are decode rows (one token per sequence, or a token and its drafts,
each a row of its own) and prompt rows: a prefill chunk's token t is a row of its own, attending to the keys up to
its position through its sequence's block table, which is what the module path's paged prefill kernel computes for it
(each query as a decode row). It runs the row and block code the module path runs, in the same order, so a row gets
the same bits either way; what it removes is Python between the ops and a thread fork per op (about two thirds of a
batch-1 decode step's time outside the matrix products). Steps with a prefill chunk that has nothing cached and
passes PAGED_PREFILL_MAX tokens (there the module path uses torch's attention on the fresh K/V of its full-attention
layers) take the module path. The batch-invariant mode takes the stack too: each of its rows is computed on its own.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from deepinfer.layers.activation import ACTS
from deepinfer.layers.attention import KERNEL_CACHES, paged_prefill_takes
from deepinfer.layers.context import AttentionMetadata, get_forward_context



def _linear_args(linear: nn.Module) -> tuple:
    packed = linear.weight.packed
    bias = linear.bias.detach() if linear.bias is not None else None
    return (*packed.op_args, bias)


NORMS = ("norm_in", "post_attn", "pre_ffn", "post_ffn", "q_norm", "k_norm")  # DecodeStack::Norm's order (ops.h)


def row_tables(md: AttentionMetadata, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of the step: its block table (padded) and context length (position + 1), decode rows first, then each
    prefill chunk's tokens; None where the rows are not exactly those, or a chunk goes to SDPA on the module path
    (attention.paged_prefill_takes)."""
    nd = md.num_decodes
    if not md.prefills:
        return (md.decode_block_tables, md.decode_context_lens) if nd == rows else None
    end = nd  # each chunk's rows must follow the ones before
    for p in md.prefills:  # a chunk the module path sends to SDPA is handed back to it
        if not paged_prefill_takes(p.context_len, p.num_tokens) or p.start != end:
            return None
        end += p.num_tokens
    if end != rows:
        return None
    width = max([md.decode_block_tables.shape[1] if nd else 0] + [p.block_table.numel() for p in md.prefills])
    tables = torch.zeros(rows, width, dtype=torch.int64)
    lens = torch.empty(rows, dtype=torch.int64)
    if nd:
        tables[:nd, :md.decode_block_tables.shape[1]] = md.decode_block_tables
        lens[:nd] = md.decode_context_lens
    for p in md.prefills:
        tables[p.start:p.start + p.num_tokens, :p.block_table.numel()] = p.block_table
        torch.arange(p.context_len - p.num_tokens + 1, p.context_len + 1, out=lens[p.start:p.start + p.num_tokens])
    return tables, lens


class DecodeStack:
    """Built from a model's decoder layers, each a dict of its parts: norm_in, qkv, q_norm / k_norm (optional, per
    head), rotary, attn, o, post_attn (optional: applied to the attention output before the residual add),
    pre_ffn, gate_up, act, down, post_ffn (optional); and the final norm. The compiled stack is made on the first
    step that uses it, and again whenever the KV cache tensors change."""

    def __init__(self, ops: ModuleType, layers: list[dict[str, Any]], final_norm: nn.Module) -> None:
        self.ops = ops
        attns = [layer["attn"] for layer in layers]
        if len({a.scale for a in attns}) != 1 or len({layer["act"].act for layer in layers}) != 1:
            raise ValueError("a decode stack needs one attention scale and one activation for all layers")
        self.cache_index = [a.cache_index for a in attns]
        self.windows = [a.sliding_window or -1 for a in attns]
        linears = [layer[name] for layer in layers for name in ("qkv", "o", "gate_up", "down")]
        self.linears = [_linear_args(linear) for linear in linears]
        # prompt rows on AMX tiles (ops/wide_linear.py), where every linear layer computes them there
        self.tiles = all(getattr(linear.weight, "tiles", False) for linear in linears)
        roles = [layer.get(name) for layer in layers for name in NORMS] + [final_norm]  # None: no such norm
        position: dict[int, int] = {}  # each norm module once, by identity, in order of first use
        modules = []
        for norm in roles:
            if norm is not None and id(norm) not in position:
                position[id(norm)] = len(modules)
                modules.append(norm)
        self.norm_index = [-1 if norm is None else position[id(norm)] for norm in roles]
        self.norms = [m.weight.detach() for m in modules]
        self.eps = [float(m.eps) for m in modules]
        self.offsets = [float(m.offset) for m in modules]
        self.shape, self.scale, self.act = list(layers[0]["shape"]), float(attns[0].scale), ACTS[layers[0]["act"].act]
        self.cos = [layer["rotary"].cos for layer in layers]
        self.sin = [layer["rotary"].sin for layer in layers]
        self._caches: list | None = None
        self._stack = None
        self.input_stage: tuple | None = None  # an MTP layer's (enorm, hnorm, eh_proj): set_input's arguments
        self._group_heads: list[int] = []  # per group of layers, its first layer (whose metadata the group uses)

    def _compiled(self, kv_caches: list, layer_attn: list | None) -> Any:
        if self._caches is not kv_caches:
            groups, heads = [], []  # layers sharing one metadata object attend through the same tables
            for i in self.cache_index:
                md = None if layer_attn is None else layer_attn[i]
                g = next((n for n, h in enumerate(heads) if layer_attn is None or layer_attn[h] is md), None)
                if g is None:
                    heads.append(i)
                    g = len(heads) - 1
                groups.append(g)
            caches = [kv_caches[i] for i in self.cache_index]
            self._stack = self.ops.DecodeStack(self.linears, self.norms, self.eps, self.offsets, self.norm_index,
                                               self.windows, groups, self.shape, self.scale, self.act, self.cos,
                                               self.sin, [k for k, _ in caches], [v for _, v in caches], self.tiles)
            if self.input_stage is not None:
                enorm, hnorm, eh_proj = self.input_stage
                self._stack.set_input([enorm.weight.detach(), hnorm.weight.detach()], [enorm.eps, hnorm.eps],
                                      [enorm.offset, hnorm.offset], _linear_args(eh_proj))
            self._caches, self._group_heads = kv_caches, heads
        return self._stack

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of the step's rows, or None where the module path must run."""
        ctx = get_forward_context()
        if ctx.cpu_kernels is None or x.dim() != 2 or x.dtype != torch.float32:
            return None
        tile_from = self._tile_from(ctx.prompt_runs, x.shape[0])
        if tile_from is None:
            return None
        if not self._reads(ctx.kv_caches):
            return None
        stack = self._compiled(ctx.kv_caches, ctx.layer_attn)
        mds = [ctx.attn_for(i) for i in self._group_heads]
        rows = [row_tables(md, x.shape[0]) for md in mds]
        if any(r is None for r in rows):
            return None
        return stack.forward(x, positions, [md.slot_mapping for md in mds], [t for t, _ in rows],
                             [n for _, n in rows], mds[0].block_size, tile_from)

    def staged_rows(self, kv_caches: list, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                    full_rows: int) -> torch.Tensor | None:
        """An MTP layer's decode rows from its inputs (the embedded next tokens and the main model's hidden states),
        input stage included; rows full_rows.. only cache their K and V. Their final-normed outputs [full_rows, H],
        or None where this stack cannot (no input stage, inputs not float32, a cache dtype the kernels do not read)."""
        if self.input_stage is None or embeds.dtype != torch.float32 or hidden.dtype != torch.float32 \
                or not self._reads(kv_caches):
            return None
        return self._compiled(kv_caches, None).forward(embeds, positions, [slots], [tables], [lens], block_size, -1,
                                                       hidden, full_rows)

    def _reads(self, kv_caches: list) -> bool:
        """Whether the compiled kernels read this cache's dtype."""
        k_cache, v_cache = kv_caches[self.cache_index[0]]
        return k_cache.dtype in KERNEL_CACHES and v_cache.dtype == k_cache.dtype

    def _tile_from(self, runs: tuple[tuple[int, int], ...], rows: int) -> int | None:
        """The first row the stack computes on AMX tiles (-1: none), or None where the prompt rows are not the
        step's last rows (the module path sends each run its own way)."""
        if not runs or not self.tiles:
            return -1
        if len(runs) == 1 and runs[0][1] == rows:
            return runs[0][0]
        return None
