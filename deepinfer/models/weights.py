"""Checkpoint tensors -> parameters: the one weight-loading mechanism every model uses.

Each parameter is reached through the checkpoint name that feeds it: a module that loads its own weights (Linear,
fused experts, quantized layers) by the names its `checkpoint_loaders(prefix, shard_name)` lists, a fused shard by
the name the model's `stacked` map gives it back (qkv_proj shard 0 -> q_proj), every other parameter by its own
name.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from deepinfer.models.gguf_file import GGUFQuantized

Loader = Callable[[torch.Tensor], None]


def checkpoint_loaders(model: nn.Module, stacked: dict[str, tuple[str, int]]) -> dict[str, Loader]:
    """Every checkpoint tensor a model expects -> the function that loads it.

    `stacked` maps a checkpoint name fragment to (fused parameter fragment, shard index). Quantized blocks (GGUF
    tensors kept as they are) reach only modules that declare `takes_quantized`; every other module gets them
    dequantized to float32."""
    unstack = {(fused, shard): fragment for fragment, (fused, shard) in stacked.items()}

    def shard_name(name: str, shard: int, num_shards: int) -> str:
        return _unstacked_name(name, shard, unstack) if num_shards > 1 else name

    loaders: dict[str, Loader] = {}
    for prefix, module in model.named_modules():
        own = getattr(module, "checkpoint_loaders", None)
        if callable(own) and module is not model:
            entries = own(prefix, shard_name)
            if not getattr(module, "takes_quantized", False):
                entries = {name: _dense_input(load) for name, load in entries.items()}
            loaders.update(entries)
            continue
        dot = f"{prefix}." if prefix else ""
        for leaf, param in module.named_parameters(recurse=False):
            loaders[dot + leaf] = _dense_input(lambda t, p=param, name=dot + leaf: _copy_checked(p, t, name))
    return loaders


def _dense_input(load: Loader) -> Loader:
    return lambda t: load(t.dense() if isinstance(t, GGUFQuantized) else t)


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
