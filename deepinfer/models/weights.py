"""Checkpoint tensors -> parameters: the one weight-loading mechanism every model uses.

Each parameter is reached through the checkpoint name that feeds it: a fused Linear shard by the name the model's
`stacked` map gives it back (qkv_proj shard 0 -> q_proj), a module that loads its own weights (fused experts) by the
names its `checkpoint_loaders(prefix)` lists, every other parameter by its own name.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from deepinfer.layers.linear import Linear

Loader = Callable[[torch.Tensor], None]


def checkpoint_loaders(model: nn.Module, stacked: dict[str, tuple[str, int]]) -> dict[str, Loader]:
    """Every checkpoint tensor a model expects -> the function that loads it.

    `stacked` maps a checkpoint name fragment to (fused parameter fragment, shard index)."""
    unstack = {(fused, shard): fragment for fragment, (fused, shard) in stacked.items()}
    loaders: dict[str, Loader] = {}
    for prefix, module in model.named_modules():
        own = getattr(module, "checkpoint_loaders", None)
        if callable(own) and module is not model:
            loaders.update(own(prefix))
            continue
        dot = f"{prefix}." if prefix else ""
        for leaf, param in module.named_parameters(recurse=False):
            name = dot + leaf
            if isinstance(module, Linear):
                for shard in range(len(module.shards)):
                    ckpt = _unstacked_name(name, shard, unstack) if len(module.shards) > 1 else name
                    loaders[ckpt] = lambda t, m=module, leaf=leaf, shard=shard: m.load_shard(leaf, t, shard)
            else:
                loaders[name] = lambda t, p=param, name=name: _copy_checked(p, t, name)
    return loaders


def load_tensors(loaders: dict[str, Loader], weights: Iterable[tuple[str, torch.Tensor]],
                 skip: Callable[[str], bool], owner: str) -> set[str]:
    """Loads every checkpoint tensor not skipped; an unknown name is an error. Returns the names loaded."""
    seen: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        if name not in loaders:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint (no parameter for it in {owner})")
        loaders[name](tensor)
        seen.add(name)
    return seen


def check_complete(expected: Iterable[str], seen: set[str]) -> None:
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))


def _unstacked_name(name: str, shard: int, unstack: dict[tuple[str, int], str]) -> str:
    for (fused, index), fragment in unstack.items():
        if index == shard and fused in name:
            return name.replace(fused, fragment)
    raise ValueError(f"no checkpoint name for shard {shard} of {name!r}: add it to the model's `stacked` map")


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
    param.data.copy_(tensor)
