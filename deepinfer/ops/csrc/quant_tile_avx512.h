// Part of quant_linear.cpp, included there inside its anonymous namespace when the build has AVX-512 VNNI: tile()
// for AVX-512. It uses load_i32, group_term and prefetch_ahead from quant_linear.cpp and follows the record layout
// and arithmetic described at its top.
#include "quant_record_avx512.h"  // load16, fifth_bits, piece_quants

// isum += w (unsigned bytes) . the 4 signed bytes at x broadcast to every lane. With DI_EMBED_BCAST (default) the
// broadcast is the dot product's own memory operand ({1to16}); from the intrinsics GCC emits a separate vpbroadcastd
// per dot product, which measured 1.03-1.12x slower on Zen 4 (SmolLM2's shapes at 64 and 128 rows; the same integer
// sums, so the same bits: `python benchmarks/quant_linear_rows.py --variants "DI_EMBED_BCAST=0;DI_EMBED_BCAST=1"`).
#ifndef DI_EMBED_BCAST
#define DI_EMBED_BCAST 1
#endif
typedef int32_t __attribute__((may_alias)) bytes4;  // the 4 int8 activations read as one operand
inline __m512i dot_bcast(__m512i isum, __m512i w, const int8_t* x) {
#if DI_EMBED_BCAST
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(isum) : "v"(w), "m"(*reinterpret_cast<const bytes4*>(x)));
  return isum;
#else
  return _mm512_dpbusd_epi32(isum, w, _mm512_set1_epi32(load_i32(x)));
#endif
}

// ng 5-bit group records (32 values) -> the same quants as ng 8-bit records: piece p's low nibbles are the 8-bit
// record's piece 2p, its high nibbles piece 2p + 1. The records are asked for kPrefetch groups ahead, as tile() does.
#define DI_WIDEN5 1
inline void widen5(const uint8_t* q, int64_t ng, uint8_t* out) {
  for (int64_t g = 0; g < ng; ++g, q += 320, out += 512) {
    for (int line = 0; line < 320; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetch * 320 + line), _MM_HINT_T0);
    for (int p = 0; p < 4; ++p) {
      __m512i wl, wh;
      piece_quants<5>(q, p, wl, wh);
      _mm512_storeu_si512(out + 128 * p, wl);
      _mm512_storeu_si512(out + 128 * p + 64, wh);
    }
  }
}

// MT activation rows x 16 output rows: out[m * ldo + 0..15].
template <int MT, int BITS, int G, typename ST, int OFF>
void tile(const uint8_t* q, const ST* s, const ST* o, float c, int64_t ng, const int8_t* xq, const float* xd,
          const int32_t* xs, const float* xt, int64_t K, float* out, int64_t ldo) {
  constexpr int QB = 16 * G * BITS / 8;
  constexpr bool folded = OFF == kFolded || OFF == kTable;
  __m512i table = _mm512_setzero_si512();  // kTable: the 16 values in each 128-bit lane, for vpshufb
  if constexpr (OFF == kTable) table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* rec = q + g * QB;
    const int64_t k0 = g * G;
    prefetch_ahead<QB>(rec, s + g * 16, OFF == kStored ? o + g * 16 : nullptr);
    __m512i isum[MT];  // a folded offset starts the integer sum at c * sum(xq)
    for (int m = 0; m < MT; ++m)
      isum[m] = folded ? _mm512_set1_epi32((int32_t)c * group_xsum<G>(xs, m, K, g)) : _mm512_setzero_si512();
    if (BITS == 4 || BITS == 5) {
      for (int p = 0; p < G / 8; ++p) {
        __m512i wl, wh;
        piece_quants<BITS>(rec, p, wl, wh);
        if constexpr (OFF == kTable) {  // nibble -> its table value
          wl = _mm512_shuffle_epi8(table, wl);
          wh = _mm512_shuffle_epi8(table, wh);
        }
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = xq + m * K + k0 + 8 * p;
          isum[m] = dot_bcast(isum[m], wl, x);
          isum[m] = dot_bcast(isum[m], wh, x + 4);
        }
      }
    } else {
      for (int p = 0; p < G / 4; ++p) {
        const __m512i w = _mm512_loadu_si512(rec + 64 * p);
        for (int m = 0; m < MT; ++m)
          isum[m] = dot_bcast(isum[m], w, xq + m * K + k0 + 4 * p);
      }
    }
    const __m512 sv = load16(s + g * 16);
    const __m512 ov = OFF == kStored ? load16(o + g * 16) : _mm512_mul_ps(sv, _mm512_set1_ps(c));
    for (int m = 0; m < MT; ++m) {
      const __m512 d = _mm512_set1_ps(xd[m * (K / 32) + k0 / 32]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(sv, d), acc[m]);
      if (!folded) acc[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(*group_term<G>(xt, m, K, g)), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

