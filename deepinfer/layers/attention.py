"""Paged attention: write this step's K/V into cache slots, then attend through block tables."""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.context import get_forward_context


# Prefill chunks whose context is at most this many tokens go through the compiled paged kernel (each query run as a
# decode row, straight from the cache) rather than SDPA on the fresh K/V. Re-measured at stop 37 (one causal
# sequence, 2 cores, bfloat16 cache against float32 fresh K/V for SDPA; SDPA time / kernel time): SmolLM2 shapes
# 1.97 / 1.16 / 1.23 / 1.13 / 0.96 at 512 / 1,024 / 2,048 / 3,072 / 4,096 tokens, Gemma 3's full layers 1.93 / 1.44 /
# 1.23 / 1.11 / 1.25 (doc/inference_deployment_qa.md, "Decode attention"). Sliding-window layers take the kernel at
# any length once the context passes the window (SDPA computes the whole masked square: Gemma 3, window 512, 2.0x at
# 1,024 tokens, 3.8x at 2,048, 6.8x at 4,096). A chunk with cached context (a prefix-cache hit, a long prompt's
# later chunks) takes the kernel at any length: torch must gather and widen the whole context first (1.1-1.7x for
# 256-2,048 rows over 1,024-8,192 tokens of bfloat16 context, 3-40x for 1-16 rows; SmolLM2 shapes, stop 33).
PAGED_PREFILL_MAX = 3072
NARROW_CACHES = (torch.bfloat16, torch.float8_e4m3fn)  # caches float32 K/V are rounded into by the kernels
KERNEL_CACHES = (torch.float32, *NARROW_CACHES)  # caches the compiled attention reads


def paged_prefill_takes(context_len: int, num_tokens: int, window: int | None = None) -> bool:
    """Whether a prefill chunk goes through the compiled paged kernel: a context up to PAGED_PREFILL_MAX, any context
    read from the cache (torch would gather and widen all of it first), or a sliding window the context passes; a
    longer chunk with nothing cached goes to SDPA."""
    return (context_len <= PAGED_PREFILL_MAX or context_len != num_tokens
            or (window is not None and context_len > window))


def cache_copy(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows, rounded to the cache's dtype as torch rounds them, into cache[slots] (a float8 cache through its bytes:
    torch has no index_copy_ for float8 on the CPU)."""
    rows = rows.to(cache.dtype)
    if cache.element_size() == 1:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.index_copy_(0, slots, rows)


class Attention(nn.Module):
    """softmax(q k^T * scale [+ mask]) v over a sequence's cached and new tokens.

    `sliding_window` W means a query at position p sees keys at positions (p - W, p].
    Layers are numbered by `cache_index` into the step's list of KV caches.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        cache_index: int,
        sliding_window: int | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scale = scale
        self.cache_index = cache_index
        self.sliding_window = sliding_window
        self.ops: ModuleType | None = None  # fused CPU cache write (transforms/fused_ops.py); None: index_copy_

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k [T, Hkv, D], v [T, Hkv, Dv] into this layer's cache at the step's slots; returns the cache (K, V)."""
        ctx = get_forward_context()
        slots = ctx.attn_for(self.cache_index).slot_mapping
        k_cache, v_cache = ctx.kv_caches[self.cache_index]
        if self.ops is not None and v_cache.dtype == k_cache.dtype and k.dtype == v.dtype \
                and (k.dtype == k_cache.dtype or (k.dtype == torch.float32 and k_cache.dtype in NARROW_CACHES)):
            self.ops.cache_write(k, v, k_cache, v_cache, slots)
        else:
            cache_copy(k_cache, slots, k)
            cache_copy(v_cache, slots, v)
        return k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [T, H * Dv]."""
        ctx = get_forward_context()
        md = ctx.attn_for(self.cache_index)
        k_cache, v_cache = self.write(k, v)
        kernels = ctx.cpu_kernels if self.head_dim == self.v_head_dim in (64, 128, 256) \
            and q.dtype == torch.float32 and k_cache.dtype in KERNEL_CACHES else None
        if ctx.batch_invariant:
            return self._batch_invariant(q, k_cache, v_cache, md, kernels).reshape(q.shape[0], -1)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        tiled = self._prompt_tiles(q, k_cache, v_cache, md, kernels, out)
        nd = md.num_decodes
        if nd and kernels is not None:
            out[:nd] = kernels.paged_decode(q[:nd].contiguous(), k_cache, v_cache, md.decode_block_tables,
                                            md.decode_context_lens, md.block_size, self.scale,
                                            self.sliding_window or -1)
            nd = 0
        for start, end, width in md.decode_buckets or ((0, nd, None),) if nd else ():
            tables = md.decode_block_tables[start:end, :width]
            out[start:end] = self._decode(q[start:end], k_cache, v_cache, tables, md.decode_context_lens[start:end],
                                          md.block_size)
        for seq in md.prefills:
            if self._rest_after_tiles(seq, tiled.get(seq.start, 0), q, k_cache, v_cache, md, kernels, out):
                continue
            rows = slice(seq.start, seq.start + seq.num_tokens)
            if kernels is not None and paged_prefill_takes(seq.context_len, seq.num_tokens, self.sliding_window):
                out[rows] = kernels.paged_prefill(q[rows].contiguous(), k_cache, v_cache, seq.block_table,
                                                  seq.context_len - seq.num_tokens, md.block_size, self.scale,
                                                  self.sliding_window or -1)
                continue
            first = 0  # first key position any of these queries sees
            if self.sliding_window is not None:
                first = max(0, seq.context_len - seq.num_tokens - self.sliding_window + 1)
            if seq.context_len == seq.num_tokens:  # nothing cached: attend over the fresh K/V directly
                keys, values = k[rows], v[rows]
                first = 0
            else:
                slots = context_slots(seq.block_table, seq.context_len, md.block_size, first)
                keys, values = k_cache[slots], v_cache[slots]
            out[rows] = self._prefill(q[rows], keys, values, seq.context_len, first)
        return out.reshape(q.shape[0], -1)

    def _batch_invariant(self, q, k_cache, v_cache, md, kernels) -> torch.Tensor:
        """Every token's result from its own data only. With the compiled kernels, decode rows and each prefill
        query run the same per-query code (ops/cpu_attention.py); otherwise ops/batch_invariant.py's fixed split."""
        if kernels is None:
            from deepinfer.ops.batch_invariant import paged_attention

            return paged_attention(self, q, k_cache, v_cache, md)
        q = q.contiguous()
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        tiled = self._prompt_tiles(q, k_cache, v_cache, md, kernels, out)
        window = self.sliding_window or -1
        nd = md.num_decodes
        if nd:
            out[:nd] = kernels.paged_decode(q[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_context_lens,
                                            md.block_size, self.scale, window)
        for seq in md.prefills:
            if self._rest_after_tiles(seq, tiled.get(seq.start, 0), q, k_cache, v_cache, md, kernels, out):
                continue
            rows = slice(seq.start, seq.start + seq.num_tokens)
            out[rows] = kernels.paged_prefill(q[rows], k_cache, v_cache, seq.block_table,
                                              seq.context_len - seq.num_tokens, md.block_size, self.scale, window)
        return out

    def _prompt_tiles(self, q, k_cache, v_cache, md, kernels, out) -> dict[int, int]:
        """Each prefill chunk's rows at prompt positions (ForwardContext.prompt_runs: set where the linear layers
        compute them on AMX tiles) attend on AMX tiles too (csrc/amx_attention.cpp; a bfloat16 cache): a row's kernel
        follows from its position, as the linear layers' does, so its bits do not depend on its chunk. Returns how
        many leading rows of each chunk (by its first row) went there."""
        runs = get_forward_context().prompt_runs
        if not runs or kernels is None or k_cache.dtype != torch.bfloat16 or not hasattr(kernels, "amx_attention"):
            return {}
        tiled = {}
        for seq in md.prefills:
            n = next((min(end, seq.start + seq.num_tokens) - seq.start for start, end in runs
                      if start <= seq.start < end), 0)
            if n:
                rows = slice(seq.start, seq.start + n)
                out[rows] = kernels.amx_attention(q[rows].contiguous(), k_cache, v_cache, seq.block_table,
                                                  seq.context_len - seq.num_tokens, md.block_size, self.scale,
                                                  self.sliding_window or -1)
                tiled[seq.start] = n
        return tiled

    def _rest_after_tiles(self, seq, n, q, k_cache, v_cache, md, kernels, out) -> bool:
        """Whether a chunk is done once its first n rows went to the tiles: True when n covers it, or after its
        remaining rows (generated tokens recomputed after a preemption) took the per-query kernel; False: none went."""
        if n == 0:
            return False
        if n < seq.num_tokens:
            rows = slice(seq.start + n, seq.start + seq.num_tokens)
            out[rows] = kernels.paged_prefill(q[rows].contiguous(), k_cache, v_cache, seq.block_table,
                                              seq.context_len - seq.num_tokens + n, md.block_size, self.scale,
                                              self.sliding_window or -1)
        return True

    def _decode(self, q, k_cache, v_cache, block_tables, context_lens, block_size):
        if self.sliding_window is not None:  # skip the leading blocks no row's window reaches
            skip = max(0, int(context_lens.min()) - self.sliding_window) // block_size
            if skip:
                block_tables, context_lens = block_tables[:, skip:], context_lens - skip * block_size
        n, max_blocks = block_tables.shape
        length = max_blocks * block_size
        # a cache narrower than the queries (bfloat16 under float32 compute) is widened after the gather
        keys = _gather_blocks(k_cache, block_tables, block_size).view(n, length, self.num_kv_heads, -1).to(q.dtype)
        values = _gather_blocks(v_cache, block_tables, block_size).view(n, length, self.num_kv_heads, -1).to(q.dtype)
        pos = torch.arange(length, device=q.device)
        visible = pos[None, :] < context_lens[:, None]
        if self.sliding_window is not None:
            visible &= pos[None, :] > (context_lens[:, None] - 1 - self.sliding_window)
        mask = visible[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out.squeeze(2)

    def _prefill(self, q, keys, values, context_len, first_key=0):
        """Queries at the last q.shape[0] positions of context_len; keys at positions first_key..context_len-1."""
        t = q.shape[0]
        visible = None
        # queries and keys the same positions, no window cutting in: the mask is exactly causal, which SDPA
        # computes without a mask tensor and skips the blocks above the diagonal (same bits, measured: ~20% less
        # time at 512 tokens; tests/ops/test_cpu_attention.py checks the equality)
        causal = first_key == 0 and t == context_len and (self.sliding_window is None
                                                           or context_len <= self.sliding_window)
        if not causal:
            q_pos = torch.arange(context_len - t, context_len, device=q.device)[:, None]
            k_pos = torch.arange(first_key, context_len, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if self.sliding_window is not None:
                visible &= k_pos > q_pos - self.sliding_window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
            values.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=visible, is_causal=causal, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out.squeeze(0).transpose(0, 1)


def context_slots(block_table: torch.Tensor, length: int, block_size: int, first: int = 0) -> torch.Tensor:
    """Flat cache slots of positions first..length-1 of a sequence."""
    pos = torch.arange(first, length, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole blocks copied with index_select on a [num_blocks, block_size * row] view (memcpy-sized rows;
    several times faster on a CPU than advanced indexing of a 4-d view)."""
    rows = cache.view(cache.shape[0] // block_size, -1)
    return rows.index_select(0, block_tables.flatten())
