"""Linear layers on block-quantized weights for the CPU (csrc/quant_linear.cpp), and the packed layout they read.

A weight in this layout is unsigned quants u with one scale (and, for affine formats, one offset) per group of G
values along K: w = scale * u + offset, or scale * (u + c) for symmetric formats (offset = c * scale). A table format
(GGUF's IQ4_NL / IQ4_XS) stores 4-bit indexes into 16 unsigned 8-bit values: w = scale * (table[u] + c). Every GGUF
type deepinfer computes on maps onto it without changing a value (models/gguf_blocks.py), and so do the int8 / int4
formats that `--quantization` makes from float weights. The kernel rounds activations to int8 per 32 values, as
llama.cpp does, and accumulates integer dot products per group; see the C++ source for the exact order.

The kernels are compiled by ops/cpu_ops.py, for the instruction set the CPU has.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

ROWS_PER_BLOCK = 16  # output rows interleaved in one packed record (the lanes of a 512-bit register)


@dataclass(frozen=True)
class QuantFormat:
    bits: int  # 4 (two quants per byte), 5 (4-bit quants plus a plane of high bits: GGUF Q5_0 / Q5_1 / Q5_K) or 8
    group: int  # values per scale along K: 32, or 16 (GGUF Q6_K)
    scale_dtype: str  # "float16" (exact for GGUF's legacy types) or "float32" (K-types' products d * sub-scale)
    affine: bool  # offsets stored per group; else offset = c * scale
    c: int = 0  # symmetric formats: w = scale * (u + c)
    table: tuple[int, ...] | None = None  # 4-bit indexes into these 16 values (0..255): w = scale * (table[u] + c)

    def __post_init__(self) -> None:
        if (self.bits, self.group) not in ((4, 32), (5, 32), (8, 32), (8, 16)):
            raise ValueError(f"unsupported quantized format: {self.bits}-bit quants in groups of {self.group}")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"scale_dtype must be float16 or float32, got {self.scale_dtype!r}")
        if self.table is not None and (self.bits != 4 or self.affine or len(self.table) != 16
                                       or not all(0 <= v <= 255 for v in self.table)):
            raise ValueError("a table format has 4-bit symmetric quants indexing 16 values in 0..255")

    @property
    def bits_per_weight(self) -> float:
        scale_bits = 16 if self.scale_dtype == "float16" else 32
        return self.bits + scale_bits * (2 if self.affine else 1) / self.group


@dataclass(frozen=True)
class Canonical:
    """A weight as unsigned quants u [N, K] (uint8) with scales / offsets [N, K / group] (float32)."""

    fmt: QuantFormat
    u: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None  # None: symmetric (offset = c * scale)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], in the kernel's own rounding (scale * u + offset, or scale * (u + c))."""
        g = self.fmt.group
        s = np.repeat(self.scales.astype(np.float32), g, axis=1)
        if self.offsets is None:
            return s * (self.values().astype(np.float32) + np.float32(self.fmt.c))
        return s * self.u.astype(np.float32) + np.repeat(self.offsets.astype(np.float32), g, axis=1)

    def values(self) -> np.ndarray:
        """The unsigned 8-bit quants the dot products read: u, or table[u] for a table format."""
        table = self.fmt.table
        return self.u if table is None else np.asarray(table, dtype=np.uint8)[self.u]

    def without_table(self) -> Canonical:
        """The same weight as 8-bit quants (table[u]), for stacking with shards of other formats."""
        if self.fmt.table is None:
            return self
        f = self.fmt
        return Canonical(QuantFormat(8, f.group, f.scale_dtype, False, f.c), self.values(), self.scales, None)


@dataclass(frozen=True)
class PackedWeight:
    fmt: QuantFormat
    n: int
    k: int
    quants: torch.Tensor  # uint8 [n_pad / 16, k / group, record bytes]
    scales: torch.Tensor  # float16 / float32 [n_pad / 16, k / group, 16]
    offsets: torch.Tensor  # same; empty for symmetric formats; a table format's 16 values (uint8)
    small: bool = False  # 8-bit records whose quants are all below 64 (GGUF Q6_K's), found by pack()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.offsets))

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.quants, self.scales, self.offsets)

    @functools.cached_property
    def op_args(self) -> tuple:
        """The kernel's weight arguments, looked up once: a decode step calls the kernel 121 times (SmolLM2). 8-bit
        records whose quants are all below 64 (GGUF Q6_K's) go as bits 6: AVX2 without VNNI multiplies them unsigned,
        without the sign flip a full byte needs (csrc/quant_tile_avx2.h); the other builds read them as 8-bit."""
        bits = 6 if self.small else self.fmt.bits
        return (self.quants, self.scales, self.offsets, bits, self.fmt.group, float(self.fmt.c), self.n)


def unify(parts: list[Canonical]) -> Canonical:
    """Fused shards (q|k|v, gate|up) stacked along N in one format that holds each exactly: the wider quants, the
    smaller group, float32 scales if any part has them, and stored offsets unless every part shares one c."""
    if len(parts) == 1:
        return parts[0]
    if len({p.fmt for p in parts}) == 1 and parts[0].fmt.table is not None:  # one table format: stacked as it is
        return Canonical(parts[0].fmt, np.concatenate([p.u for p in parts]), np.concatenate([p.scales for p in parts]),
                         None)
    parts = [p.without_table() for p in parts]
    bits = max(p.fmt.bits for p in parts)
    group = min(p.fmt.group for p in parts)
    scale_dtype = "float32" if any(p.fmt.scale_dtype == "float32" for p in parts) else "float16"
    cs = {p.fmt.c for p in parts if not p.fmt.affine}
    affine = any(p.fmt.affine for p in parts) or len(cs) > 1
    fmt = QuantFormat(bits, group, scale_dtype, affine, 0 if affine else cs.pop())
    us, ss, os_ = [], [], []
    for p in parts:
        r = p.fmt.group // group  # a group of 32 as two groups of 16: the same scale twice
        s = np.repeat(p.scales, r, axis=1)
        us.append(p.u)
        ss.append(s)
        if affine:
            os_.append(np.repeat(p.offsets, r, axis=1) if p.offsets is not None else s * np.float32(p.fmt.c))
    return Canonical(fmt, np.concatenate(us), np.concatenate(ss), np.concatenate(os_) if affine else None)


def pack(w: Canonical) -> PackedWeight:
    """The kernel's interleaved layout: per 16 output rows and group, 64-byte pieces with 4 bytes per row; 5-bit
    quants are their low 4 bits in the 4-bit layout followed by the high bits, 8 bytes per 64-byte register of
    nibbles (bit i for byte i: the low nibbles' register, then the high nibbles', per piece)."""
    fmt, (n, k) = w.fmt, w.u.shape
    g = fmt.group
    if k % 32 or k % g:
        raise ValueError(f"a quantized weight needs K a multiple of 32, got K={k}")
    n_pad = -(-n // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
    u = np.zeros((n_pad, k), dtype=np.uint8)
    u[:n] = w.u
    nb, ng = n_pad // ROWS_PER_BLOCK, k // g
    blocks = u.reshape(nb, ROWS_PER_BLOCK, ng, g).transpose(0, 2, 1, 3)  # [nb, ng, row, value]
    if fmt.bits == 8:  # piece p: bytes 4j + b = row j, value 4p + b
        rec = blocks.reshape(nb, ng, ROWS_PER_BLOCK, g // 4, 4).transpose(0, 1, 3, 2, 4)
    else:  # piece p: row j, values 8p + b (low nibble) and 8p + 4 + b (high nibble)
        v = blocks.reshape(nb, ng, ROWS_PER_BLOCK, g // 8, 2, 4)
        nib = v & 0x0F
        rec = (nib[..., 0, :] | (nib[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)
    quants = np.ascontiguousarray(rec).reshape(nb, ng, -1)
    if fmt.bits == 5:  # [piece, nibble, row j, b] -> bit 4j + b of the piece's low / high-nibble mask
        high = (v >> 4).transpose(0, 1, 3, 4, 2, 5).reshape(nb, ng, g // 8, 2, 64)
        plane = np.packbits(high, axis=-1, bitorder="little").reshape(nb, ng, -1)
        quants = np.concatenate([quants, plane], axis=2)
    sdt = np.float16 if fmt.scale_dtype == "float16" else np.float32

    def lanes(values: np.ndarray) -> torch.Tensor:
        padded = np.zeros((n_pad, ng), dtype=np.float32)
        padded[:n] = values
        exact = padded.astype(sdt)
        if not np.array_equal(exact.astype(np.float32), padded, equal_nan=True):  # a NaN scale is a NaN scale
            raise ValueError(f"scales are not exact in {fmt.scale_dtype}")
        return torch.from_numpy(np.ascontiguousarray(exact.reshape(nb, ROWS_PER_BLOCK, ng).transpose(0, 2, 1)))

    if fmt.table is not None:
        offsets = torch.tensor(fmt.table, dtype=torch.uint8)
    else:
        offsets = lanes(w.offsets) if w.offsets is not None else torch.empty(0, dtype=torch.float32)
    # found here, while u is at hand, not by a scan of the packed quants on the first step
    small = fmt.bits == 8 and fmt.table is None and w.u.size > 0 and int(w.u.max()) < 64
    return PackedWeight(fmt, n, k, torch.from_numpy(quants), lanes(w.scales), offsets, small)


INT8 = QuantFormat(8, 32, "float16", False, -128)
INT4 = QuantFormat(4, 32, "float16", True)

# A greedy step of at most this many rows takes a split head's argmax in two passes; larger ones widen every block
# (csrc/split_head.cpp). Gemma 3's head on the 2-core Zen 4 EPYC, on its own final states, against the 8-bit
# layout: 1 row 1.43x, 2 rows 1.18x, 3 rows 0.70x (doc/inference_deployment_qa.md, "An 8-bit LM head in split planes").
SPLIT_ARGMAX_ROWS = 2


@dataclass(frozen=True)
class SplitWeight:
    """An 8-bit symmetric weight (GGUF Q8_0, int8: w = d * (u - 128)) stored as a 5-bit plane of u >> 3 and three bit
    planes of u & 7 (csrc/split_head.cpp has the layout): a greedy LM head reads the high plane, 5/8 of the bytes,
    and computes exactly only the blocks that can hold the largest output. Logits, rows and the argmax are the
    ones the PackedWeight it was made from gives; the bytes are the same but 8 per output row (`bound`)."""

    n: int
    k: int
    high: torch.Tensor  # uint8 [n_pad / 16, k / 32, 320]
    low: torch.Tensor  # uint8 [n_pad / 16, k / 32, 192]
    scales: torch.Tensor  # float16 [n_pad / 16, k / 32, 16]
    bound: torch.Tensor  # float32 [n_pad, 2]: R_i and E2_i of split_head.cpp, rounded up
    max_rows: int = SPLIT_ARGMAX_ROWS

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.high, self.low, self.scales, self.bound)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def splittable(w: PackedWeight) -> bool:
    return w.fmt == INT8


def _round_up(x: np.ndarray) -> np.ndarray:
    return np.nextafter(x.astype(np.float32), np.float32(np.inf))


def split(w: PackedWeight, max_rows: int = SPLIT_ARGMAX_ROWS, chunk: int = 1024) -> SplitWeight:
    """The two planes and per-row bounds of an 8-bit symmetric weight (Q8_0 / int8), block by block."""
    if not splittable(w):
        raise ValueError(f"only 8-bit symmetric weights in groups of 32 split, not {w.fmt}")
    nb, ng = w.quants.shape[:2]
    high = np.empty((nb, ng, 320), dtype=np.uint8)
    low = np.empty((nb, ng, 192), dtype=np.uint8)
    bound = np.empty((nb, 16, 2), dtype=np.float32)
    gamma = (2 * ng + 16) * 2.0 ** -23
    shifts = np.arange(3, dtype=np.uint8)[:, None]
    for b0 in range(0, nb, chunk):
        r = w.quants[b0 : b0 + chunk].numpy().reshape(-1, ng, 8, 64)  # 8-bit records: piece, byte 4j + i
        n = r.shape[0]
        hi, lo = r >> 3, r & 7
        nib = hi & 0x0F
        fifth = np.packbits((hi >> 4).reshape(n, ng, 4, 2, 64), axis=-1, bitorder="little")
        high[b0 : b0 + n, :, :256] = (nib[:, :, 0::2] | (nib[:, :, 1::2] << 4)).reshape(n, ng, 256)
        high[b0 : b0 + n, :, 256:] = fifth.reshape(n, ng, 64)
        planes = (lo[:, :, :, None, :] >> shifts) & 1  # [n, ng, register, bit, 64]
        low[b0 : b0 + n] = np.packbits(planes, axis=-1, bitorder="little").reshape(n, ng, 192)
        d = w.scales[b0 : b0 + n].numpy().astype(np.float64)  # [n, ng, 16]
        centred = (lo.reshape(n, ng, 8, 16, 4).astype(np.float64) - 3.5) ** 2
        bound[b0 : b0 + n, :, 0] = _round_up(np.sqrt((d * d * centred.sum(axis=(2, 4))).sum(axis=1)) * (1 + 2.0 ** -20))
        bound[b0 : b0 + n, :, 1] = _round_up(gamma * 760 * np.abs(d).max(axis=1) * (1 + 2.0 ** -20))
    return SplitWeight(w.n, w.k, torch.from_numpy(high), torch.from_numpy(low), w.scales,
                       torch.from_numpy(bound.reshape(nb * 16, 2)), max_rows)


def quantize_int8(w: np.ndarray) -> Canonical:
    """Symmetric int8 per 32 values: scale = max|w| / 127 (rounded to float16 first), q = round(w / scale)."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"int8 quantization needs K a multiple of 32, got K={k}")
    g = w.reshape(n, k // 32, 32).astype(np.float32)
    scale = (np.abs(g).max(axis=2) / 127).astype(np.float16).astype(np.float32)
    inv = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127)
    return Canonical(INT8, (q + 128).astype(np.uint8).reshape(n, k), scale, None)


def quantize_int4(w: np.ndarray) -> Canonical:
    """Affine int4 per 32 values: offset = min (float16), scale = (max - offset) / 15 (float16), u = round."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"int4 quantization needs K a multiple of 32, got K={k}")
    g = w.reshape(n, k // 32, 32).astype(np.float32)
    low = g.min(axis=2).astype(np.float16).astype(np.float32)
    scale = ((g.max(axis=2) - low) / 15).astype(np.float16).astype(np.float32)
    inv = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    u = np.clip(np.rint((g - low[..., None]) * inv[..., None]), 0, 15)
    return Canonical(INT4, u.astype(np.uint8).reshape(n, k), scale, low)


def linear(kernels: ModuleType, x: torch.Tensor, w: PackedWeight | SplitWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] float32."""
    if x.shape[-1] != w.k:
        raise ValueError(f"quantized linear takes inputs of {w.k} features, got {x.shape[-1]}")
    if isinstance(w, SplitWeight):
        if bias is not None:
            raise ValueError("a split head has no bias")
        return kernels.split_head_linear(x.reshape(-1, w.k), w.high, w.low, w.scales, w.n).view(*x.shape[:-1], w.n)
    if x.dim() == 2:  # the decode path: no reshaping
        return kernels.quant_linear(x, *w.op_args, bias)
    lead = x.shape[:-1]
    return kernels.quant_linear(x.reshape(-1, w.k), *w.op_args, bias).view(*lead, w.n)


def argmax(kernels: ModuleType, x: torch.Tensor, w: PackedWeight | SplitWeight) -> torch.Tensor:
    """x [M, K] float32 -> [M] int64: per row, the index of the largest of linear(x, w)'s outputs (the first of
    equals; the first NaN), what torch.argmax of the outputs gives, computed without writing them."""
    if x.dim() != 2 or x.shape[-1] != w.k:
        raise ValueError(f"quantized argmax takes [M, {w.k}] inputs, got {tuple(x.shape)}")
    if isinstance(w, SplitWeight):
        return kernels.split_head_argmax(x, w.high, w.low, w.scales, w.bound, w.n, w.max_rows)
    return kernels.quant_linear_argmax(x, *w.op_args)


# Greedy steps of at least this many rows take a bounded head's argmax in two passes (csrc/bounded_argmax.cpp); fewer
# stay on quant_linear_argmax, which streams the weight at about the memory's rate there (Zen 3, the head alone on
# its own final states: SmolLM2 0.96x / 1.08x / 1.24x / 1.33x at 2 / 4 / 16 / 64 rows, Gemma 3 ~1.07x at 2-3 rows).
BOUNDED_ARGMAX_ROWS = 4


def boundable(w: PackedWeight | SplitWeight) -> bool:
    """Whether csrc/bounded_argmax.cpp takes this weight: 8-bit symmetric quants with c = -128 in groups of 32 and
    float16 scales (GGUF Q8_0, int8)."""
    return isinstance(w, PackedWeight) and w.fmt == INT8 and not w.small


def argmax_bound(kernels: ModuleType, w: PackedWeight) -> torch.Tensor:
    """float32 [n_pad / 16, 2, 16]: per output, the factors of ||x||_2 and ||x||_1 in bounded_argmax's bound."""
    if not boundable(w):
        what = getattr(w, "fmt", type(w).__name__)
        raise ValueError(f"a bounded argmax needs an 8-bit symmetric weight with float16 scales, not {what}")
    return kernels.quant_argmax_bound(w.quants, w.scales, w.k)


def bounded_argmax(kernels: ModuleType, x: torch.Tensor, w: PackedWeight, bound: torch.Tensor) -> torch.Tensor:
    """argmax(kernels, x, w), the same indices, in two passes: the top 6 bits of each quant bound every output and
    only blocks that can hold a row's largest are computed exactly (csrc/bounded_argmax.cpp)."""
    if x.dim() != 2 or x.shape[-1] != w.k:
        raise ValueError(f"quantized argmax takes [M, {w.k}] inputs, got {tuple(x.shape)}")
    return kernels.quant_argmax_bounded(x, *w.op_args, bound)


def rows(kernels: ModuleType, ids: torch.Tensor, w: PackedWeight | SplitWeight) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized to float32: [*ids.shape, K]."""
    if isinstance(w, SplitWeight):
        return kernels.split_head_rows(ids.reshape(-1), w.high, w.low, w.scales, w.k).view(*ids.shape, w.k)
    out = kernels.quant_rows(ids.reshape(-1), w.quants, w.scales, w.offsets, w.fmt.bits, w.fmt.group,
                             float(w.fmt.c), w.k)
    return out.view(*ids.shape, w.k)
