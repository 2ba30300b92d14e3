"""Linear and embedding layers whose weight stays block-quantized (ops/quant_linear.py); transforms/quantize.py
swaps them in before the weights load.

A layer receives each checkpoint tensor either as quantized blocks (anything with a `canonical()` method: GGUF
tensors kept as they are in the file) or as a float tensor, which it quantizes in its own format (int8 / int4).
Without the compiled kernels it computes on the dequantized float32 weight: slower, same values.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.context import current_forward_context
from deepinfer.ops import quant_linear as ql
from deepinfer.ops import wide_linear as wl

QUANT_MODES = ("gguf", "int8", "int4")


def _to_canonical(tensor: Any, mode: str) -> ql.Canonical:
    if hasattr(tensor, "canonical"):
        return tensor.canonical()
    w = tensor.detach().float().cpu().numpy()
    return ql.quantize_int4(w) if mode == "int4" else ql.quantize_int8(w)


class QuantWeight:
    """One quantized matrix: its shards while loading, then packed once (and dequantized only without kernels).
    A plain object, not a parameter: tying the LM head to the embedding assigns the same QuantWeight to both."""

    def __init__(self, num_shards: int, kernels: ModuleType | None) -> None:
        self.kernels = kernels
        self._shards: list[ql.Canonical | None] = [None] * num_shards
        self.packed: ql.PackedWeight | ql.SplitWeight | None = None
        self.dense: torch.Tensor | None = None  # float32, only when the kernels are unavailable
        self.tiles = False  # prompt rows in bfloat16 on AMX tiles (ops/wide_linear.py)
        self.argmax_bound: torch.Tensor | None = None  # an LM head's greedy steps in two passes (bound_head)

    def load_shard(self, canonical: ql.Canonical, shard: int) -> None:
        self._shards[shard] = canonical

    @property
    def loaded(self) -> bool:
        return self.packed is not None or all(s is not None for s in self._shards)

    def finalize(self, unify: Callable[[list[ql.Canonical]], ql.Canonical], split: int | None = None,
                 tiles: bool = False) -> None:
        """split: an LM head's 8-bit symmetric weight of at least this many bytes goes in split planes
        (ops/quant_linear.SplitWeight) where the kernels have them; None: it stays packed. tiles: prompt rows go to
        AMX tiles (ops/wide_linear.py), where the kernels can compute on them."""
        if self.packed is not None or self.dense is not None:
            return
        whole = unify(self._shards)
        self._shards = []
        if self.kernels is None:
            self.dense = torch.from_numpy(np.ascontiguousarray(whole.dequantize()))
            return
        self.packed = ql.pack(whole)
        if (split is not None and self.packed.nbytes >= split and ql.splittable(self.packed)
                and hasattr(self.kernels, "split_head_argmax")):
            self.packed = ql.split(self.packed)
        self.tiles = tiles and wl.available(self.kernels) and isinstance(self.packed, ql.PackedWeight) \
            and self.packed.fmt.table is None  # the AMX path dequantizes linear quants only

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return 0 if self.dense is None else self.dense.numel() * 4


class QuantizedLinear(nn.Module):
    """y = x W^T + b on a quantized W made of output shards (q|k|v, gate|up), float32 in and out."""

    takes_quantized = True  # models/weights.py hands it GGUF blocks as they are

    def __init__(self, in_features: int, shards: list[int], bias: nn.Parameter | None, mode: str,
                 kernels: ModuleType | None, head: bool = False) -> None:
        super().__init__()
        self.head = head  # an LM head (its weight may go in split planes: transforms/quantize.py)
        self.in_features = in_features
        self.shards = list(shards)
        self.mode = mode
        self.weight = QuantWeight(len(self.shards), kernels)
        self.bias = bias

    def checkpoint_loaders(self, prefix: str, shard_name: Callable[[str, int, int], str]) -> dict[str, Callable]:
        dot = f"{prefix}." if prefix else ""
        loaders = {shard_name(dot + "weight", i, len(self.shards)): (lambda t, i=i: self._load(t, i))
                   for i in range(len(self.shards))}
        if self.bias is not None:
            loaders.update({shard_name(dot + "bias", i, len(self.shards)): (lambda t, i=i: self._load_bias(t, i))
                            for i in range(len(self.shards))})
        return loaders

    def _load(self, tensor: Any, shard: int) -> None:
        canonical = _to_canonical(tensor, self.mode)
        expected = (self.shards[shard], self.in_features)
        if canonical.u.shape != expected:
            raise ValueError(f"shape mismatch for weight shard {shard}: checkpoint {canonical.u.shape}, "
                             f"expected {expected}")
        self.weight.load_shard(canonical, shard)

    def _load_bias(self, tensor: torch.Tensor, shard: int) -> None:
        start = sum(self.shards[:shard])
        self.bias.data[start : start + self.shards[shard]].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.packed is None:
            return F.linear(x.float(), w.dense, self.bias)
        runs = _prompt_runs(x) if w.tiles else ()
        if not runs:
            return ql.linear(w.kernels, x.float(), w.packed, self.bias)
        return _by_runs(w, x.float(), runs, self.bias)


def _prompt_runs(x: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The forward context's prompt rows, where x is the step's token rows (a layer fed other rows, or called
    outside a forward pass, computes every row on the blocks)."""
    ctx = current_forward_context()
    if ctx is None or not ctx.prompt_runs or x.dim() != 2 or x.shape[0] != ctx.positions.shape[0]:
        return ()
    return ctx.prompt_runs


def _by_runs(w: QuantWeight, x: torch.Tensor, runs: tuple[tuple[int, int], ...],
             bias: torch.Tensor | None) -> torch.Tensor:
    """Prompt rows on the bfloat16 tiles, the others on the quantized blocks: each row's kernel follows from its
    own position, never from its neighbours, and both kernels compute a row alone as inside any batch."""
    rows = x.shape[0]
    if runs == ((0, rows),):
        return wl.linear(w.kernels, x, w.packed, bias)
    out = x.new_empty(rows, w.packed.n)
    done = 0
    for start, end in runs:
        if start > done:
            out[done:start] = ql.linear(w.kernels, x[done:start], w.packed, bias)
        out[start:end] = wl.linear(w.kernels, x[start:end], w.packed, bias)
        done = end
    if done < rows:
        out[done:] = ql.linear(w.kernels, x[done:], w.packed, bias)
    return out


def head_argmax(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(head(hidden), -1) without the [rows, vocab] outputs, for an LM head computing on quantized blocks
    with the compiled kernels and no bias; None otherwise (the caller computes the logits)."""
    if not isinstance(head, QuantizedLinear):
        return None
    w = head.weight
    if w.packed is None or head.bias is not None or not hasattr(w.kernels, "quant_linear_argmax"):
        return None
    if w.argmax_bound is not None and hidden.shape[0] >= ql.BOUNDED_ARGMAX_ROWS:
        return ql.bounded_argmax(w.kernels, hidden.float(), w.packed, w.argmax_bound)
    return ql.argmax(w.kernels, hidden.float(), w.packed)


def bound_head(head: nn.Module) -> bool:
    """Lets an LM head on 8-bit symmetric blocks (Q8_0, int8) take greedy steps of several rows in two passes
    (ops/quant_linear.bounded_argmax: the same tokens); False where it cannot (another format, a bias, split
    planes, no compiled op)."""
    if not isinstance(head, QuantizedLinear) or head.bias is not None:
        return False
    w = head.weight
    if w.packed is None or not ql.boundable(w.packed) or not hasattr(w.kernels, "quant_argmax_bounded"):
        return False
    if w.argmax_bound is None:
        w.argmax_bound = ql.argmax_bound(w.kernels, w.packed)
    return True


class QuantizedEmbedding(nn.Module):
    """Looks up rows of a quantized table, dequantizing only those rows (the same bits as a dense lookup of the
    dequantized table)."""

    takes_quantized = True

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str, kernels: ModuleType | None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.weight = QuantWeight(1, kernels)

    def checkpoint_loaders(self, prefix: str, shard_name: Callable[[str, int, int], str]) -> dict[str, Callable]:
        return {f"{prefix}.weight": self._load}

    def _load(self, tensor: Any) -> None:
        canonical = _to_canonical(tensor, "int8" if self.mode == "int4" else self.mode)
        if canonical.u.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape mismatch for embedding: checkpoint {canonical.u.shape}, expected "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        self.weight.load_shard(canonical, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.packed is not None:
            return ql.rows(w.kernels, ids, w.packed)
        return F.embedding(ids, w.dense)
