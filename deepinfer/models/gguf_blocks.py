"""GGUF quantized blocks -> unsigned quants with per-group scales and offsets (ops/quant_linear.py's Canonical).

Each type's block layout, as ggml defines it (w = the dequantized weight):
  Q4_0  32 values: d fp16, 16 bytes of nibbles (low: values 0-15, high: 16-31); w = d * (q - 8)
  Q4_1  32 values: d, m fp16, nibbles as Q4_0; w = d * q + m
  Q5_0  32 values: d fp16, qh (32 high bits, bit i for value i), nibbles as Q4_0; w = d * (q - 16)
  Q5_1  32 values: d, m fp16, qh, nibbles; w = d * q + m
  Q8_0  32 values: d fp16, 32 int8; w = d * q
  Q4_K  256 values: d, dmin fp16, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 bytes of nibbles
        (per 64 values: 32 bytes, low nibbles the first 32, high nibbles the next 32); w = d * sc * q - dmin * m
  Q5_K  as Q4_K plus 32 bytes qh (value l of 64-value chunk i: bit 2i of qh[l] for the low half, 2i + 1 the high)
  Q6_K  256 values: ql 128 bytes (low 4 bits), qh 64 bytes (high 2 bits), 16 int8 scales (per 16 values), d fp16;
        w = d * sc * (q - 32)
  Q2_K  256 values: 16 bytes of 4-bit (scale, min) pairs (per 16 values), 64 bytes of 2-bit quants (value l of
        32-value chunk j of half h: bits 2j of byte 32h + l), d, dmin fp16; w = d * sc * q - dmin * m
  Q3_K  256 values: hmask 32 bytes (value l of chunk j of half h: bit 4h + j of byte l), 64 bytes of low 2 bits (as
        Q2_K), 12 bytes of 6-bit scales (per 16 values), d fp16; w = d * (sc - 32) * (q - 4), q = low | high << 2
  IQ4_NL  32 values: d fp16, nibbles as Q4_0; w = d * T[q], T the 16 signed 8-bit values of ggml's kvalues_iq4nl
  IQ4_XS  256 values: d fp16, 2 high bits and 4 low bits of 6-bit scales (per 32 values), nibbles per 32 as Q4_0;
        w = d * (sc - 32) * T[q]
Nothing is rounded on the way: legacy types keep their fp16 scales; K types get float32 products d * sc (an fp16
times a small integer is exact in float32), which the packed layout stores as float32. Q3_K is 8-bit records: its
(sc - 32) * (q - 4) lies in [-124, 128], so u = that + 124 with the fp16 d as the scale of each 32 values
(c = -124). The IQ4 types keep their 4-bit q as indexes into a table format's values T[q] + 128 (c = -128). Q2_K
keeps q with the float32 d * sc and -dmin * m per 16 values. Each w is then the product ggml's own dequantization
computes, to the bit.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

from deepinfer.ops.quant_linear import Canonical, QuantFormat

SUPPORTED = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K,
             QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl
IQ4_TABLE = tuple(v + 128 for v in IQ4_VALUES)  # as unsigned bytes, with c = -128


BLOCK_VALUES = {t: 32 if t in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL) else 256
                for t in SUPPORTED}  # values per block


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row -> float32 [rows, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[B, 16] bytes -> [B, 32] values: low nibbles are values 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """[B, 4] bytes (a little-endian uint32) -> [B, 32] bits, bit i for value i."""
    bits = np.ascontiguousarray(qh).view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    q = scales.astype(np.uint8)
    sc = np.empty((q.shape[0], 8), dtype=np.uint8)
    mn = np.empty((q.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = q[:, 0:4] & 63
    mn[:, :4] = q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 128] bytes -> [B, 256] values: per 64 values, 32 bytes' low nibbles then their high nibbles."""
    q = qs.reshape(-1, 4, 32)
    return np.stack([q & 0x0F, q >> 4], axis=2).reshape(-1, 256)


def canonical(qtype: QType, raw: np.ndarray, shape: tuple[int, int]) -> Canonical:
    """raw: the tensor's bytes (uint8, any shape); shape: (rows N, values per row K)."""
    n, k = shape
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype.name} cannot be computed on directly; supported: "
                         f"{', '.join(t.name for t in SUPPORTED)}")
    per = BLOCK_VALUES[qtype]
    if k % per:
        raise ValueError(f"a {qtype.name} row must hold a multiple of {per} values, got {k}")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n * k // per, -1)

    def done(fmt: QuantFormat, u: np.ndarray, s: np.ndarray, o: np.ndarray | None) -> Canonical:
        g = fmt.group
        return Canonical(fmt, u.reshape(n, k).astype(np.uint8), s.reshape(n, k // g).astype(np.float32),
                         None if o is None else o.reshape(n, k // g).astype(np.float32))

    if qtype == QType.Q4_0:
        return done(QuantFormat(4, 32, "float16", False, -8), _nibbles32(blocks[:, 2:]), _f16(blocks[:, :2]), None)
    if qtype == QType.Q4_1:
        return done(QuantFormat(4, 32, "float16", True), _nibbles32(blocks[:, 4:]), _f16(blocks[:, :2]),
                    _f16(blocks[:, 2:4]))
    if qtype == QType.Q5_0:
        u = _nibbles32(blocks[:, 6:]) | (_high_bits32(blocks[:, 2:6]) << 4)
        return done(QuantFormat(5, 32, "float16", False, -16), u, _f16(blocks[:, :2]), None)
    if qtype == QType.Q5_1:
        u = _nibbles32(blocks[:, 8:]) | (_high_bits32(blocks[:, 4:8]) << 4)
        return done(QuantFormat(5, 32, "float16", True), u, _f16(blocks[:, :2]), _f16(blocks[:, 2:4]))
    if qtype == QType.Q8_0:
        u = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return done(QuantFormat(8, 32, "float16", False, -128), u, _f16(blocks[:, :2]), None)
    if qtype in (QType.Q4_K, QType.Q5_K):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        u = _k_nibbles(blocks[:, 16:144] if qtype == QType.Q4_K else blocks[:, 48:176])
        if qtype == QType.Q5_K:  # value l of chunk i: bit 2i (first 32) / 2i + 1 (next 32) of qh[l]
            qh = blocks[:, 16:48]
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)  # [chunk, half, 1]
            high = (qh[:, None, None, :] >> shifts) & 1  # [B, 4, 2, 32]
            u = u | (high.reshape(-1, 256) << 4)
        fmt = QuantFormat(4 if qtype == QType.Q4_K else 5, 32, "float32", True)
        return done(fmt, u, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)))
    if qtype in (QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS):
        return done(*_low_bit(qtype, blocks))
    # Q6_K
    ql, qh = blocks[:, :128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low = np.concatenate([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    u = (low | (high << 4)).reshape(-1, 256)
    return done(QuantFormat(8, 16, "float32", False, -32), u, d * scales, None)


def _two_bit_chunks(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K: [B, 64] bytes -> [B, 256] 2-bit values: per 128-value half h, chunk j's value l is bits 2j of
    byte 32h + l."""
    q = qs.reshape(-1, 2, 1, 32)
    return ((q >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)


def _q3_scales(b: np.ndarray) -> np.ndarray:
    """Q3_K: 12 bytes -> 16 six-bit scales: low 4 bits of scale i from byte i % 8 (nibble i // 8), high 2 bits from
    byte 8 + i % 4 (bits 2 (i // 4))."""
    i = np.arange(16)
    low = (b[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
    high = (b[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return (low | (high << 4)).astype(np.int16)


def _low_bit(qtype: QType, blocks: np.ndarray) -> tuple[QuantFormat, np.ndarray, np.ndarray, np.ndarray | None]:
    """Q2_K, Q3_K, IQ4_NL, IQ4_XS: (format, u, scales, offsets) as the module docstring describes."""
    if qtype == QType.Q2_K:
        sc, d, dmin = blocks[:, :16], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        u = _two_bit_chunks(blocks[:, 16:80])
        return QuantFormat(8, 16, "float32", True), u, d * (sc & 0x0F), -(dmin * (sc >> 4))
    if qtype == QType.Q3_K:
        low = _two_bit_chunks(blocks[:, 32:96]).astype(np.int16)
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)  # [1, half, chunk, 1]: bit 4h + j
        high = ((blocks[:, None, None, :32] >> shifts) & 1).reshape(-1, 256).astype(np.int16)
        scale = np.repeat(_q3_scales(blocks[:, 96:108]) - 32, 16, axis=1)
        u = scale * (low + 4 * high - 4) + 124
        return QuantFormat(8, 32, "float16", False, -124), u, np.repeat(_f16(blocks[:, 108:110]), 8, axis=1), None
    nib = blocks[:, -16 * (BLOCK_VALUES[qtype] // 32):].reshape(-1, 16)
    u = _nibbles32(nib).reshape(blocks.shape[0], -1)  # indexes into the table
    d = _f16(blocks[:, :2])
    if qtype == QType.IQ4_NL:
        return QuantFormat(4, 32, "float16", False, -128, IQ4_TABLE), u, d, None
    ib = np.arange(8)
    scales_h = blocks[:, 2:4].copy().view("<u2").astype(np.int16)
    ls = ((blocks[:, 4 + ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4)
    return QuantFormat(4, 32, "float32", False, -128, IQ4_TABLE), u, d * (ls - 32).astype(np.float32), None
