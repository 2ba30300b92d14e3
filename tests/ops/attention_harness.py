"""Drives layers.attention.Attention through the runner's metadata for hand-made steps, with the switch on or off."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.layers.attention import Attention
from deepinfer.layers.context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context


@dataclass
class Sequence:
    """Per-position q/k/v of one sequence: a position's inputs never depend on how it is scheduled."""

    q: torch.Tensor  # [L, H, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor  # [L, Hkv, Dv]
    blocks: list[int]

    @property
    def length(self) -> int:
        return self.q.shape[0]


def random_sequence(length: int, layer: Attention, blocks: list[int], seed: int, dtype=torch.float32) -> Sequence:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return Sequence(rand(length, layer.num_heads, layer.head_dim), rand(length, layer.num_kv_heads, layer.head_dim),
                    rand(length, layer.num_kv_heads, layer.v_head_dim), blocks)


class Cache:
    def __init__(self, layer: Attention, num_blocks: int, block_size: int, dtype=torch.float32) -> None:
        self.block_size = block_size
        self.kv = [(torch.zeros(num_blocks * block_size, layer.num_kv_heads, layer.head_dim, dtype=dtype),
                    torch.zeros(num_blocks * block_size, layer.num_kv_heads, layer.v_head_dim, dtype=dtype))]


def step(layer: Attention, cache: Cache, work: list[tuple[Sequence, int, int]], invariant: bool) -> list[torch.Tensor]:
    """One forward over (sequence, first position, number of tokens) entries; returns each entry's output rows.

    As the runner does: one-token entries first (the decode batch), then one PrefillSeq per longer entry.
    """
    order = sorted(range(len(work)), key=lambda i: work[i][2] != 1)
    bs = cache.block_size
    q, k, v, slots, prefills, rows = [], [], [], [], [], {}
    decode_tables, decode_lens = [], []
    row = 0
    for i in order:
        seq, start, n = work[i]
        pos = torch.arange(start, start + n)
        table = torch.tensor(seq.blocks, dtype=torch.int64)
        q.append(seq.q[start : start + n])
        k.append(seq.k[start : start + n])
        v.append(seq.v[start : start + n])
        slots.append(table[pos // bs] * bs + pos % bs)
        if n == 1:
            decode_tables.append(seq.blocks)
            decode_lens.append(start + 1)
        else:
            prefills.append(PrefillSeq(row, n, start + n, table))
        rows[i] = slice(row, row + n)
        row += n
    nd = len(decode_lens)
    tables = lens = None
    if nd:
        width = max(len(t) for t in decode_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int64)
        lens = torch.tensor(decode_lens, dtype=torch.int64)
    md = AttentionMetadata(torch.cat(slots), nd, tables, lens, prefills, bs)
    positions = torch.cat([torch.arange(work[i][1], work[i][1] + work[i][2]) for i in order])
    ctx = ForwardContext(md, cache.kv, positions, batch_invariant=invariant)
    with forward_context(ctx):
        out = layer(torch.cat(q), torch.cat(k), torch.cat(v)).view(row, layer.num_heads, layer.v_head_dim)
    return [out[rows[i]] for i in range(len(work))]
