// Part of quant_linear.cpp (included there when the build has AVX-512): quantize_row's body for up to 16 blocks
// (512 values) of one activation row at once. The per-block reductions (each block's max, each 16 values' sum) are
// done for the 16 blocks together by transposed trees (reduce16_avx512.h) instead of one horizontal reduction per
// register, which made the rounding 5-8% of a batch-64 decode step. The same bits as the portable body: a block's
// max is exact in any order (no lane is NaN: a NaN is dropped by the max with the other half or with zero), the
// divisions and products are the same IEEE operations lane for lane, and integer sums are exact.
#pragma once
#include <immintrin.h>

#include "reduce16_avx512.h"

constexpr int kRoundBlocks = 16;  // blocks per call

// x, xq: the n x 32 values (n = 16 where FULL); xd: the n blocks' d; xs, xt16: their 2n sums per 16 values and
// offset factors; xt32: the n offset factors per 32 values. Lanes past n compute on zeros and are not stored.
template <bool FULL>
static inline void quantize_blocks(const float* x, int8_t* xq, float* xd, int32_t* xs, float* xt16, float* xt32,
                                   int n) {
  if (FULL) n = 16;
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 mx[16];
  __m512i q0[16], q1[16];  // registers past n are read as zeros (not stored: a loop of stores became a memset)
  for (int i = 0; i < n; ++i) {
    const float* v = x + 32 * i;
    const __m512 a = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(v), absmask), _mm512_setzero_ps());
    mx[i] = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(v + 16), absmask), a);
  }
  const __m512 d = _mm512_div_ps(hmax16([&](int i) { return FULL || i < n ? mx[i] : _mm512_setzero_ps(); }),
                                 _mm512_set1_ps(127.f));
  const __mmask16 pos = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ);
  alignas(64) float id[16];
  _mm512_store_ps(id, _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.f), d));
  const __mmask16 blocks = (__mmask16)((1u << n) - 1);  // lanes of the n blocks; then of their 2n halves
  const __mmask16 first = n >= 8 ? (__mmask16)0xFFFF : (__mmask16)((1u << (2 * n)) - 1);
  const __mmask16 second = n <= 8 ? (__mmask16)0 : (__mmask16)((1u << (2 * n - 16)) - 1);
  _mm512_mask_storeu_ps(xd, blocks, d);
  for (int i = 0; i < n; ++i) {
    const __m512 inv = _mm512_set1_ps(id[i]);
    q0[i] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * i), inv));
    q1[i] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * i + 16), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 32 * i), _mm512_cvtepi32_epi8(q0[i]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 32 * i + 16), _mm512_cvtepi32_epi8(q1[i]));
  }
  const __m512i s0 = hsum16_epi32([&](int i) { return FULL || i < n ? q0[i] : _mm512_setzero_si512(); });
  const __m512i s1 = hsum16_epi32([&](int i) { return FULL || i < n ? q1[i] : _mm512_setzero_si512(); });
  // lane i of s0, s1: block i's first and second 16 values' sums
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_mask_storeu_epi32(xs, first, _mm512_permutex2var_epi32(s0, lo, s1));  // xs[2b] = s0, xs[2b + 1] = s1
  _mm512_mask_storeu_epi32(xs + 16, second, _mm512_permutex2var_epi32(s0, hi, s1));
  const __m512 t0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s0)), t1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s1));
  _mm512_mask_storeu_ps(xt16, first, _mm512_permutex2var_ps(t0, lo, t1));  // offset factors per 16 values, per 32
  _mm512_mask_storeu_ps(xt16 + 16, second, _mm512_permutex2var_ps(t0, hi, t1));
  _mm512_mask_storeu_ps(xt32, blocks, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1))));
}
