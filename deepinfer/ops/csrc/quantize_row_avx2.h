// Part of quant_linear.cpp (included there when the build has AVX2 but not AVX-512): quantize_row's body for up to
// 8 blocks (256 values) of one activation row at once, as quantize_row_avx512.h does for 16: each block's max and
// each 16 values' sum for the 8 blocks together by one transposed tree, not a horizontal reduction per block. The
// same bits as the portable body: a block's max is exact in any order (a NaN is dropped by the max, as there), the
// divisions and products are the same IEEE operations lane for lane, the integer sums are exact, and each value's
// byte is the low byte of its int32, as the portable body's (int8_t) cast keeps.
#pragma once
#include <immintrin.h>

// Lane i of the result: v(i)[0] op ... op v(i)[7] (v: an accessor, so a caller with fewer registers passes zeros).
template <typename Get, typename Op>
static inline __m256 reduce8_lanes(Get v, Op op) {
  __m256 s[4], t[2];
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: [v2j 0+2, v2j+1 0+2, v2j 1+3, v2j+1 1+3]
    s[j] = op(_mm256_unpacklo_ps(v(2 * j), v(2 * j + 1)), _mm256_unpackhi_ps(v(2 * j), v(2 * j + 1)));
  for (int j = 0; j < 2; ++j) {  // per 128-bit lane: the four registers 4j..4j+3, each reduced over that lane
    const __m256d a = _mm256_castps_pd(s[2 * j]), b = _mm256_castps_pd(s[2 * j + 1]);
    t[j] = op(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return op(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
}

static inline __m256 as_ps(__m256i v) { return _mm256_castsi256_ps(v); }
static inline __m256i as_si(__m256 v) { return _mm256_castps_si256(v); }

constexpr int kRoundBlocks = 8;  // blocks per call

// x, xq: the n x 32 values (n = 8 where FULL); xd: the n blocks' d; xs, xt16: their 2n sums per 16 values and
// offset factors; xt32: the n offset factors per 32 values.
template <bool FULL>
static inline void quantize_blocks(const float* x, int8_t* xq, float* xd, int32_t* xs, float* xt16, float* xt32,
                                   int n) {
  if (FULL) n = 8;
  const __m256 absmask = as_ps(_mm256_set1_epi32(0x7FFFFFFF)), zero = _mm256_setzero_ps();
  __m256 mx[8];
  __m256i p0[8], p1[8];  // per block: its first and second 16 values' int32 pairs added lane by lane
  for (int i = 0; i < n; ++i) {
    __m256 m = zero;  // vmaxps returns its second operand where either is NaN: the running max skips a NaN
    for (int r = 0; r < 4; ++r) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + 32 * i + 8 * r), absmask), m);
    mx[i] = m;
  }
  const auto max = [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); };
  const __m256 d = _mm256_div_ps(reduce8_lanes([&](int i) { return FULL || i < n ? mx[i] : zero; }, max),
                                 _mm256_set1_ps(127.f));
  alignas(32) float id[8];  // 1 / d where d > 0, else 0
  _mm256_store_ps(id, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.f), d), _mm256_cmp_ps(d, zero, _CMP_GT_OQ)));
  const __m256i byte = _mm256_set1_epi32(0xFF), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < n; ++i) {
    const __m256 inv = _mm256_set1_ps(id[i]);
    __m256i q[4];
    for (int r = 0; r < 4; ++r) q[r] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * i + 8 * r), inv));
    // each int32's low byte (exact through the unsigned packs once masked), back in value order
    const __m256i w01 = _mm256_packus_epi32(_mm256_and_si256(q[0], byte), _mm256_and_si256(q[1], byte));
    const __m256i w23 = _mm256_packus_epi32(_mm256_and_si256(q[2], byte), _mm256_and_si256(q[3], byte));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 32 * i),
                        _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23), order));
    p0[i] = _mm256_add_epi32(q[0], q[1]);
    p1[i] = _mm256_add_epi32(q[2], q[3]);
  }
  const auto add = [](__m256 a, __m256 b) { return as_ps(_mm256_add_epi32(as_si(a), as_si(b))); };
  const __m256i s0 = as_si(reduce8_lanes([&](int i) { return FULL || i < n ? as_ps(p0[i]) : zero; }, add));
  const __m256i s1 = as_si(reduce8_lanes([&](int i) { return FULL || i < n ? as_ps(p1[i]) : zero; }, add));
  const __m256 t0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s0)), t1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s1));
  const __m256 t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)));
  // pairs (block b's first, second) in block order: unpack within 128-bit lanes, then the lanes put in order
  const __m256i slo = _mm256_unpacklo_epi32(s0, s1), shi = _mm256_unpackhi_epi32(s0, s1);
  const __m256 tlo = _mm256_unpacklo_ps(t0, t1), thi = _mm256_unpackhi_ps(t0, t1);
  alignas(32) int32_t sp[16];
  alignas(32) float tp[16], dv[8], tv[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sp), _mm256_permute2x128_si256(slo, shi, 0x20));
  _mm256_store_si256(reinterpret_cast<__m256i*>(sp + 8), _mm256_permute2x128_si256(slo, shi, 0x31));
  _mm256_store_ps(tp, _mm256_permute2f128_ps(tlo, thi, 0x20));
  _mm256_store_ps(tp + 8, _mm256_permute2f128_ps(tlo, thi, 0x31));
  _mm256_store_ps(dv, d);
  _mm256_store_ps(tv, t);
  for (int i = 0; i < n; ++i) {
    xd[i] = dv[i];
    xt32[i] = tv[i];
    xs[2 * i] = sp[2 * i];
    xs[2 * i + 1] = sp[2 * i + 1];
    xt16[2 * i] = tp[2 * i];
    xt16[2 * i + 1] = tp[2 * i + 1];
  }
}
