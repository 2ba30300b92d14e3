"""What every model file shares: the runner-facing contract and checked weight loading."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from deepinfer.core.kv_layout import KVCacheSpec
from deepinfer.models.weights import check_complete, checkpoint_loaders, load_tensors


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits(hidden [N, H]) -> [N, V]."""

    # checkpoint name fragment -> (fused parameter fragment, shard index)
    stacked: dict[str, tuple[str, int]] = {}
    # checkpoint tensors that are fine to drop (e.g. precomputed rotary buffers)
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # parameters kept in float32 whatever the compute dtype (routers, correction biases), as the reference does
    fp32_param_suffixes: tuple[str, ...] = ()

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Called after loading when the checkpoint omits tied tensors."""

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden).argmax(-1) without the logits, where the model can (None: compute them)."""
        return None

    def optional_weights(self) -> set[str]:
        """Parameters a checkpoint may omit (tied embeddings)."""
        return set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaders = checkpoint_loaders(self, self.stacked)
        seen = load_tensors(loaders, weights, lambda name: name.endswith(self.ignored_suffixes), type(self).__name__)
        check_complete(set(loaders) - self.optional_weights(), seen)
        self.tie_weights()
