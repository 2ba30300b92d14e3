"""Multi-head latent attention (DeepSeek-V2 §2.1, V3 §2.1.1) over a compressed paged KV cache.

Per token and layer the cache holds one row of kv_lora_rank + qk_rope_head_dim values: the latent
c = RMSNorm(W_DKV x) and the shared RoPE key k_pe, stored as a single-head K entry (V stays empty).

  keys   k_h = [W_UK_h c ; k_pe]        values v_h = W_UV_h c          (W_UK | W_UV = kv_b_proj)
  score  q_h . k_h = [W_UK_h^T q_nope_h ; q_pe_h] . [c ; k_pe]
  output o_h = W_UV_h (sum_j p_hj c_j)

Decode uses the right-hand ("absorbed") forms: queries move into the latent space, attention runs over the
cached rows as they are, and W_UV is applied once to the weighted latent. Prefill expands K and V from the
latents (cheaper when many queries share the keys). Both compute the same attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.attention import cache_copy, context_slots
from deepinfer.layers.context import get_forward_context
from deepinfer.layers.linear import Linear
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding


class MLAttention(nn.Module):
    """hidden [T, H] at positions [T] -> [T, H]; reads and writes layer `cache_index` of the step's KV caches.

    Checkpoint-facing submodules carry DeepSeek's names. With a q LoRA rank, q_a_proj and kv_a_proj_with_mqa
    (both read the hidden state) are one fused `qkv_a_proj`: shard 0 = q_a_proj, shard 1 = kv_a_proj_with_mqa.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rotary: RotaryEmbedding,
        cache_index: int,
        eps: float = 1e-6,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.rotary = rotary
        self.cache_index = cache_index
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        kv_a = kv_lora_rank + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk_head_dim)
            self.kv_a_proj_with_mqa = Linear(hidden_size, kv_a, bias=bias)
        else:
            self.qkv_a_proj = Linear(hidden_size, [q_lora_rank, kv_a], bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = Linear(q_lora_rank, num_heads * qk_head_dim)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), quantizable=False)
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    @property
    def cache_entry_dim(self) -> int:
        """Values cached per token: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> q [T, heads, nope + rope], its nope and (rotated) rope parts, the cache entry [T, C + R]."""
        if self.q_lora_rank is None:
            q, kv = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv = self.qkv_a_proj(x).split([self.q_lora_rank, self.cache_entry_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        entry = torch.cat((self.kv_a_layernorm(latent), k_pe.squeeze(1)), dim=-1)  # [T, C + R]
        return q, q_nope, q_pe, entry

    def _write(self, entry: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.cache_index][0]
        cache_copy(cache, ctx.attn.slot_mapping, entry.unsqueeze(1))
        return cache

    def write_kv(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Only the cache entries `forward` would write, for rows whose output nobody reads."""
        self._write(self._project(positions, x)[3])

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, q_nope, q_pe, entry = self._project(positions, x)
        cache = self._write(entry)
        md = get_forward_context().attn
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        nd = md.num_decodes
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], cache, md.decode_block_tables, md.decode_context_lens, md.block_size)
        for seq in md.prefills:
            rows = slice(seq.start, seq.start + seq.num_tokens)
            if seq.context_len == seq.num_tokens:  # nothing cached: the fresh rows are the whole context
                entries = entry[rows]
            else:
                entries = cache[context_slots(seq.block_table, seq.context_len, md.block_size)].squeeze(1)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], entries, seq.context_len)
        return self.o_proj(out.reshape(q.shape[0], -1))

    def _kv_b_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, C] and W_UV [heads, v, C], views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _decode(self, q_nope, q_pe, cache, block_tables, context_lens, block_size) -> torch.Tensor:
        """Absorbed form over the compressed cache: q_nope [n, heads, nope], q_pe [n, heads, R] -> [n, heads, v]."""
        w_uk, w_uv = self._kv_b_parts()
        n, max_blocks = block_tables.shape
        length = max_blocks * block_size
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [n, heads, C]
        query = torch.cat((q_latent, q_pe), dim=-1).to(cache.dtype)
        rows = cache.view(-1, block_size, cache.shape[-1])[block_tables].reshape(n, 1, length, -1)
        visible = torch.arange(length, device=cache.device)[None, :] < context_lens[:, None]
        # The heads act as n_heads queries against one shared key/value head: one matmul per sequence.
        latent_out = F.scaled_dot_product_attention(
            query.unsqueeze(1), rows, rows[..., : self.kv_lora_rank],
            attn_mask=visible[:, None, None, :], scale=self.scale,
        ).squeeze(1)  # [n, heads, C]
        return torch.bmm(latent_out.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope, q_pe, entries, context_len: int) -> torch.Tensor:
        """Expanded form for one sequence: t queries against its context_len cached rows -> [t, heads, v]."""
        t = q_nope.shape[0]
        latent, k_pe = entries.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent.to(self.kv_b_proj.weight.dtype)).view(context_len, self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.to(k_nope.dtype)[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        q_pos = torch.arange(context_len - t, context_len, device=q.device)[:, None]
        visible = torch.arange(context_len, device=q.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=visible, scale=self.scale,
        )
        return out.squeeze(0).transpose(0, 1)
