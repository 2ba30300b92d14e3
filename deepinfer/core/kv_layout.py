"""Layer groups: how attention layers share KV blocks, and what sliding-window layers may drop.

Every group holds the same number of layers, so one block of the shared pool (block_size tokens of one layer per
slot) serves any group. Full-attention groups keep a block for every token; a sliding-window group with window W
only needs the blocks that intersect the last W positions. A model with one kind of layer is one group of all its
layers: one block table per request, as before. Gemma 3 270M (15 sliding layers, 3 full) is six groups of three
layers: one full group and five sliding ones, each with its own block table, all drawing from one pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


NULL_BLOCK = -1  # a sliding-window table entry whose block was dropped (outside the window, or never loaded)
SWA_MODES = ("compact", "full")


@dataclass(frozen=True)
class KVCacheSpec:
    """Per attention layer: what one token stores. `sliding_window` None means full attention."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVGroup:
    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]  # attention layer indices; the i-th uses cache slot i


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @property
    def is_hybrid(self) -> bool:
        return any(g.sliding_window is not None for g in self.groups)

    def placement(self, num_layers: int) -> list[tuple[int, int]]:
        """Per attention layer: (group, slot)."""
        where = [(-1, -1)] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                where[layer] = (g, slot)
        return where

    def blocks_for(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks one sequence of num_tokens holds at most, computing at most max_chunk tokens per step."""
        total = 0
        for group in self.groups:
            span = num_tokens if group.sliding_window is None else min(num_tokens, group.sliding_window + max_chunk)
            total += -(-span // block_size) + (group.sliding_window is not None)
        return total


def layout_from_specs(specs: list[KVCacheSpec]) -> KVLayout:
    """Groups layers by window; each kind is cut into groups of gcd(layer counts) layers. Layers in the same slot of
    different groups share one cache tensor, so they must store the same shapes (else: one group per kind of layer
    would be needed; every model here has uniform shapes when it mixes windows)."""
    by_window: dict[int | None, list[int]] = {}
    for i, spec in enumerate(specs):
        by_window.setdefault(spec.sliding_window, []).append(i)
    if len(by_window) == 1:
        ((window, layers),) = by_window.items()
        return KVLayout((KVGroup(window, tuple(layers)),))
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):  # full attention first
        layers = by_window[window]
        groups += [KVGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    shapes = {(s.num_kv_heads, s.head_dim, s.v_head_dim) for s in specs}
    if len(shapes) != 1:
        raise ValueError(f"sliding-window and full layers with different KV shapes are not supported: {sorted(shapes)}")
    return KVLayout(tuple(groups))


def default_keep_tokens(window: int, block_size: int, rollback_margin: int = 0) -> int:
    """Sliding-window positions a finished sequence keeps in the prefix cache in `compact` mode.

    A later request that continues the sequence hits at M, the last block boundary its full-attention match reaches,
    and needs sliding-window KV for [M - W, M). M lies at most (block_size - 1) tokens below the sequence's computed
    end C, and a speculative step may roll the end back by rollback_margin more, so the tail to keep is
    W + rollback_margin + (block_size - 1) positions; derivation and worked figures in
    doc/inference_deployment_qa.md.
    """
    return window + rollback_margin + block_size - 1
