"""The quantization transform: before the weights load, linear layers and embeddings become quantized layers
(layers/quantized.py) that keep their weight in blocks; after loading, each weight is packed once.

`gguf` keeps every GGUF tensor in its own format; `int8` / `int4` quantize float weights per 32 values (the LM
head and the embedding stay int8 under int4, as llama.cpp's mixes keep the output layer wider). Layers that read
their weight as a matrix (MLA's absorbed kv_b_proj) and rows not a multiple of 32 stay dense.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.layers.quantized import QUANT_MODES, QuantizedEmbedding, QuantizedLinear
from deepinfer.ops.huge_pages import ArenaReport, move_to_huge_pages
from deepinfer.ops.quant_linear import unify

logger = logging.getLogger("deepinfer")


@dataclass(frozen=True)
class QuantSummary:
    mode: str
    quantized: int  # layers swapped
    dense: tuple[str, ...]  # layers left dense, and why
    weight_bytes: int = 0  # packed bytes after finalize
    arena: ArenaReport | None = None  # where the packed tensors went (huge pages or not)
    tile_layers: int = 0  # layers whose prompt rows go to AMX tiles (ops/wide_linear.py)

    def pages(self) -> str:
        """For the start-up log: how much of the packed weights the kernel put in 2 MiB pages."""
        a = self.arena
        if a is None or a.tensors == 0:
            return "4 KiB pages" + (" (DEEPINFER_HUGE_PAGES=0)" if a is None else "")
        if a.huge_bytes < 0:
            return f"huge pages asked for (THP {a.mode}; granted: unknown)"
        return f"{min(a.huge_bytes, a.nbytes) / 2**20:.0f} of {a.nbytes / 2**20:.0f} MiB in 2 MiB pages (THP {a.mode})"


def prepare_quantized(model: nn.Module, mode: str, kernels: ModuleType | None) -> QuantSummary:
    """Swaps layers in place, before load_weights."""
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization must be one of {QUANT_MODES}, got {mode!r}")
    wide = "int8" if mode == "int4" else mode
    swapped, dense = 0, []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, Linear):
                if not child.quantizable or child.in_features % 32:
                    dense.append(f"{full} ({'read as a matrix' if not child.quantizable else 'K % 32'})")
                    continue
                new = QuantizedLinear(child.in_features, child.shards, child.bias, mode, kernels)
            elif isinstance(child, nn.Linear):  # LM heads
                if child.in_features % 32:
                    dense.append(f"{full} (K % 32)")
                    continue
                new = QuantizedLinear(child.in_features, [child.out_features], child.bias, wide, kernels, head=True)
            elif isinstance(child, nn.Embedding):
                if child.embedding_dim % 32:
                    dense.append(f"{full} (dim % 32)")
                    continue
                new = QuantizedEmbedding(child.num_embeddings, child.embedding_dim, wide, kernels)
            else:
                continue
            setattr(parent, name, new)
            swapped += 1
    return QuantSummary(mode, swapped, tuple(dense))


def finalize_quantized(model: nn.Module, summary: QuantSummary, huge_pages: bool = True,
                       split_head: int | None = None, tiles: bool = False) -> QuantSummary:
    """Packs every loaded quantized weight (a tied head shares its embedding's) and, with huge_pages, moves the
    packed tensors into 2 MiB pages (ops/huge_pages.py); returns the summary with bytes. split_head: an LM head
    without bias in 8-bit symmetric blocks (Q8_0, int8) of at least this many bytes goes in split planes
    (ops/quant_linear.SplitWeight); None: none does. tiles: every linear layer but the LM head computes prompt rows
    on AMX tiles, where the kernels have them (ops/wide_linear.py: no copy of the weight)."""
    heads = {id(m.weight) for m in model.modules() if isinstance(m, QuantizedLinear) and m.head and m.bias is None}
    seen, total, tensors, tile_layers = set(), 0, [], 0
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and id(module.weight) not in seen:
            w = module.weight
            seen.add(id(w))
            w.finalize(unify, split=None if split_head is None or id(w) not in heads else split_head,
                       tiles=tiles and isinstance(module, QuantizedLinear) and not module.head)
            total += w.nbytes
            if w.packed is not None:
                tensors += list(w.packed.tensors)
            tile_layers += int(w.tiles)
    arena = move_to_huge_pages(tensors) if huge_pages else None
    return QuantSummary(summary.mode, summary.quantized, summary.dense, total, arena, tile_layers)
