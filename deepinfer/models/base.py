"""What every model file shares: the runner-facing contract and checked weight loading."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from deepinfer.layers.linear import Linear


@dataclass(frozen=True)
class KVCacheSpec:
    """Per attention layer: what one token stores. `sliding_window` None means full attention."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding_window: int | None = None


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

    def optional_weights(self) -> set[str]:
        """Parameters a checkpoint may omit (tied embeddings)."""
        return set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(self.ignored_suffixes):
                continue
            target, shard = self._map_name(name)
            if target not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint (no parameter {target!r} in {type(self).__name__})")
            module_name, _, leaf = target.rpartition(".")
            module = modules[module_name]
            if isinstance(module, Linear):
                module.load_shard(leaf, tensor, shard)
                loaded.add(f"{target}#{shard}")
            else:
                param = params[target]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(target)
        self._check_complete(params, modules, loaded)
        self.tie_weights()

    def _map_name(self, name: str) -> tuple[str, int]:
        for fragment, (fused, shard) in self.stacked.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, 0

    def _check_complete(self, params: dict, modules: dict, loaded: set[str]) -> None:
        missing = [n for n in params if n not in loaded and n not in self.optional_weights()]
        for name in params:
            module_name, _, leaf = name.rpartition(".")
            module = modules[module_name]
            if name in loaded and isinstance(module, Linear) and len(module.shards) > 1:
                missing += [f"{name} (shard {i})" for i in range(len(module.shards)) if f"{name}#{i}" not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {', '.join(sorted(missing)[:10])}" + (" ..." if len(missing) > 10 else ""))
