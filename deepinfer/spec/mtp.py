"""Multi-token prediction (DeepSeek-V3 report §2.2): a draft head that reuses the main model's last hidden state.

Depth k at row i combines the representation h_i^{k-1} (for k = 1: the main model's final, normed hidden
state at position i) with the embedding of token t_{i+k}, and predicts t_{i+k+1}:

  h'_i  = W_eh [RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h_i^{k-1})]       (embedding first, as in the report,
  h_i^k = SharedHeadNorm(Block(h'_i))                                   vLLM, SGLang and transformers)
  logits = Head(h_i^k)                                                  (Emb and Head shared with the main model)

The block is a full transformer layer with its own attention, caching at its own index after the main model's
layers (`cache_index`; `write_kv` computes only what it caches): in the engine it runs on the paged KV cache like
any layer (worker/mtp.py), inside the caller's forward context; `run` instead gives it a scratch cache holding just
the rows it is given (one contiguous sequence and no history beyond it: tests and offline use).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepinfer.layers.context import AttentionMetadata, ForwardContext, PrefillSeq, forward_context
from deepinfer.layers.linear import Linear
from deepinfer.layers.norm import RMSNorm


class SharedHead(nn.Module):
    """The MTP module's own output norm; its `head` is the main model's lm_head (the checkpoint's copy is not kept)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(nn.Module):
    """One prediction depth. `block(positions, x)` is a decoder layer whose attention caches at `cache_index`."""

    def __init__(self, hidden_size: int, eps: float, block: nn.Module, cache_shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = Linear(2 * hidden_size, hidden_size)
        self.block = block
        self.shared_head = SharedHead(hidden_size, eps)
        self.cache_shape = cache_shape  # (kv heads, K dim, V dim) per token of the block's attention
        self.decode_stack = None  # decode rows through the block and the output norm in one compiled call

    @property
    def cache_index(self) -> int:
        attn = getattr(self.block.self_attn, "attn", self.block.self_attn)
        return attn.cache_index

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))

    def write_kv(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> None:
        """Only the K and V `forward` would cache at these rows: the projection and the block's K/V projections,
        not its attention or MLP (rows whose draft nobody asks for still need their KV for later drafts)."""
        self.block.write_kv(positions, self._input(embeds, hidden))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self._input(embeds, hidden)
        if self.decode_stack is not None:
            out = self.decode_stack(x, positions)  # None: rows that are not all decode rows
            if out is not None:
                return out
        return self.shared_head.norm(self.block(positions, x))


class MultiTokenPredictor(nn.Module):
    def __init__(self, layers: list[MTPLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.draft_vocab: torch.Tensor | None = None  # token ids drafts are chosen among (None: all)

    def layer(self, depth: int) -> MTPLayer:
        """Depth `depth` (0-based) reuses the layers cyclically: DeepSeek applies its MTP layers recursively when
        more drafts are wanted than the checkpoint has layers."""
        return self.layers[depth % len(self.layers)]

    def run(self, depth: int, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Depth `depth` over one contiguous sequence of T rows in a scratch cache -> h^k [T, H]."""
        layer = self.layer(depth)
        ctx = contiguous_context(positions, {layer.cache_index: layer.cache_shape}, embeds.dtype)
        with forward_context(ctx):
            return layer(positions, embeds, hidden)

    @torch.inference_mode()
    def propose(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        num_drafts: int,
        embed: Callable[[torch.Tensor], torch.Tensor],
        logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[int]:
        """Greedy drafts for one sequence.

        hidden [T, H]: the main model's final hidden states for tokens t_0..t_{T-1}; token_ids [T]: t_1..t_T
        (the last one just sampled); positions [T]: the positions of token_ids. Returns t_{T+1}, t_{T+2}, ...
        Each further depth shifts the tokens left by one and appends the previous draft.
        """
        drafts: list[int] = []
        for depth in range(num_drafts):
            hidden = self.run(depth, positions, embed(token_ids), hidden)
            drafts.append(int(logits(hidden[-1:]).argmax(dim=-1)))
            token_ids = torch.cat((token_ids[1:], token_ids.new_tensor(drafts[-1:])))
            positions = positions + 1
        return drafts


def contiguous_context(
    positions: torch.Tensor, cache_shapes: list[tuple[int, int, int]] | dict[int, tuple[int, int, int]],
    dtype: torch.dtype
) -> ForwardContext:
    """A forward context for one sequence whose T rows are its whole context, cached in scratch buffers:
    one (K [T, heads, K dim], V [T, heads, V dim]) pair per (heads, K dim, V dim) in `cache_shapes` (a list for
    every cache index, or {cache index: shape} with empty caches at the other indices)."""
    t = positions.shape[0]
    device = positions.device
    if isinstance(cache_shapes, dict):
        cache_shapes = [cache_shapes.get(i, (0, 0, 0)) for i in range(max(cache_shapes) + 1)]
    caches = [
        (torch.zeros(t, h, k, dtype=dtype, device=device), torch.zeros(t, h, v, dtype=dtype, device=device))
        for h, k, v in cache_shapes
    ]
    md = AttentionMetadata(
        slot_mapping=torch.arange(t, device=device),
        num_decodes=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillSeq(0, t, t, torch.zeros(1, dtype=torch.int64, device=device))],
        block_size=t,
    )
    return ForwardContext(attn=md, kv_caches=caches, positions=positions)
