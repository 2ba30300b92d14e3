"""The per-step attention metadata, scoped with `with forward_context(ctx):` around one forward pass."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from types import ModuleType
from typing import Iterator

import torch


@dataclass
class PrefillSeq:
    """One sequence computing several tokens: its rows of the step's token batch."""

    start: int  # first row in the token batch
    num_tokens: int
    context_len: int  # tokens in its KV after this step (cached prefix + earlier chunks + these)
    block_table: torch.Tensor  # int64 [num_blocks]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: flat cache slot (block_id * block_size + offset) per token
    num_decodes: int  # rows 0..num_decodes-1 are one token each
    decode_block_tables: torch.Tensor | None  # int64 [num_decodes, max_blocks], padded
    decode_context_lens: torch.Tensor | None  # int64 [num_decodes]
    prefills: list[PrefillSeq] = field(default_factory=list)
    block_size: int = 16
    # decode rows cut into runs of similar length (start row, end row, blocks), so short rows are not padded to
    # the longest one; None: one run of all decodes
    decode_buckets: list[tuple[int, int, int]] | None = None


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: K and V, [num_slots, kv_heads, head_dim]
    positions: torch.Tensor  # int64 [T]
    batch_invariant: bool = False  # attention must use a reduction order fixed by the request's own data
    # layer groups (sliding-window hybrids): per attention layer, its group's metadata; None: `attn` for all
    layer_attn: list[AttentionMetadata] | None = None
    # the compiled CPU attention kernels (ops/cpu_attention.py: paged_decode, paged_prefill); None: torch ops
    cpu_kernels: ModuleType | None = None
    # runs of rows [start, end) at prompt positions: linear layers whose prompt rows go to AMX tiles compute them
    # there (layers/quantized.py, ops/wide_linear.py); empty: every row on the quantized blocks
    prompt_runs: tuple[tuple[int, int], ...] = ()

    def attn_for(self, layer: int) -> AttentionMetadata:
        return self.attn if self.layer_attn is None else self.layer_attn[layer]


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("deepinfer_forward_context", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if _CURRENT.get() is not None:
        raise RuntimeError("forward contexts do not nest")
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_forward_context() -> ForwardContext | None:
    """The context of the forward pass running now, or None outside one (a layer called on its own)."""
    return _CURRENT.get()


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("no forward context: call the model inside `with forward_context(...)`")
    return ctx
