// Part of amx_linear.cpp (included there when the build has AMX-BF16): one block of 16 output columns of a
// quantized weight (quant_linear.cpp's packed records) dequantized to bfloat16 in the tile layout TDPBF16PS reads,
// [K / 32][16][32]: row r of a 32-value chunk holds the pairs (k = 2r, 2r + 1) of each of the 16 columns.
//
// A weight is w = scale * u + offset (offset = c * scale for symmetric formats: w = scale * (u + c)), a float32
// product then a float32 sum (no FMA), then rounded to bfloat16 to nearest even: Canonical.dequantize's values
// (ops/quant_linear.py) rounded as torch's .to(torch.bfloat16) rounds them.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "quant_record_avx512.h"  // load16, piece_quants

namespace amx_dequant {

inline __m512 load_lanes(const void* p, bool half, int64_t i) {
  return half ? load16(static_cast<const uint16_t*>(p) + i) : load16(static_cast<const float*>(p) + i);
}

// The 8-bit-layout piece q (lane j's 4 bytes: column j, k = 4q..4q+3 of the chunk) -> tile rows 2q and 2q + 1.
// sv / ov: the 16 columns' scales / offsets. Byte i of each lane taken by a shift and a mask: the lanes stay the
// columns, and the pairs are interleaved once in bfloat16.
inline void piece_rows(__m512i piece, __m512 sv, __m512 ov, bool affine, int c, uint16_t* rows) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  __m512 w[4];
  for (int i = 0; i < 4; ++i) {
    __m512i u = i == 3 ? _mm512_srli_epi32(piece, 24) : _mm512_and_si512(_mm512_srli_epi32(piece, 8 * i), byte);
    if (!affine) u = _mm512_add_epi32(u, _mm512_set1_epi32(c));  // u + c: exact either way
    const __m512 p = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(u));
    w[i] = affine ? _mm512_add_ps(p, ov) : p;
  }
  // [k0 of columns 0-15, k1 of columns 0-15] -> (k0, k1) of column 0, of column 1, ...
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(rows, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0])));
  _mm512_storeu_si512(rows + 32, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2])));
}

// Group g of column block b of w into its rows of out [K / 32][16][32] bfloat16 bits.
inline void group_rows(const QuantView& w, int64_t b, int64_t g, uint16_t* out) {
  const int64_t ng = w.k / w.group, qb = 16 * w.group * w.bits / 8;
  const uint8_t* q = w.quants + (b * ng + g) * qb;
  const int c = (int)w.c;
  const int64_t i = (b * ng + g) * 16;
  const __m512 sv = load_lanes(w.scales, w.half, i);
  const __m512 ov = w.affine ? load_lanes(w.offsets, w.half, i) : _mm512_setzero_ps();
  // this group's values start at k = g * group: tile row (k % 32) / 2 of chunk k / 32
  uint16_t* rows = out + (g * w.group / 32) * 512 + (g * w.group % 32) / 2 * 32;
  if (w.bits == 8) {
    for (int p = 0; p < w.group / 4; ++p)
      piece_rows(_mm512_loadu_si512(q + 64 * p), sv, ov, w.affine, c, rows + 64 * p);
    return;
  }
  for (int p = 0; p < 4; ++p) {  // nibbles: piece p's low halves are k = 8p..8p+3, its high halves 8p+4..8p+7
    __m512i lo, hi;
    if (w.bits == 5) piece_quants<5>(q, p, lo, hi);
    else piece_quants<4>(q, p, lo, hi);
    piece_rows(lo, sv, ov, w.affine, c, rows + 128 * p);
    piece_rows(hi, sv, ov, w.affine, c, rows + 128 * p + 64);
  }
}

// The tiles of a column pair (blocks b, b + 1 if it exists) into out [2][K / 32][16][32], group by group: step()
// does one group, so the tile loop can interleave the next pair's dequantization with its own products (the vector
// units then work while the tile unit does).
struct PairJob {
  const QuantView* w = nullptr;
  int64_t b = 0, done = 0, total = 0;  // groups done / to do, over both blocks
  uint16_t* out = nullptr;

  void start(const QuantView& view, int64_t block, uint16_t* tiles) {
    const int64_t ng = view.k / view.group;
    w = &view, b = block, out = tiles, done = 0, total = (block + 1 < view.nb ? 2 : 1) * ng;
  }
  bool pending() const { return done < total; }
  void step() {
    if (done == total) return;
    const int64_t ng = w->k / w->group, j = done / ng;
    group_rows(*w, b + j, done % ng, out + j * (w->k / 32) * 512);
    ++done;
  }
  void finish() {
    while (done < total) step();
  }
};

}  // namespace amx_dequant
