// Transposed reductions of 16 AVX-512 registers (included where __AVX512F__ is defined): lane i of the result is
// v[i][0] op v[i][1] op ... op v[i][15], by a tree of in-lane unpacks and 128-bit lane shuffles: ~2 shuffles and
// 1 op per register instead of 4 and 4 for one reduction per register. The tree's shape is fixed, so a lane's
// value depends on its own register only (for a sum of floats, on that fixed order).
#pragma once
#include <immintrin.h>

// v(i): register i (an accessor, so that a caller with fewer registers passes zeros without storing them).
template <typename Get, typename Op>
static inline __m512 reduce16_lanes(Get v, Op op) {
  __m512 s[8], t[4], u[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [v2j 0+2, v2j+1 0+2, v2j 1+3, v2j+1 1+3]
    s[j] = op(_mm512_unpacklo_ps(v(2 * j), v(2 * j + 1)), _mm512_unpackhi_ps(v(2 * j), v(2 * j + 1)));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the four vectors 4j..4j+3, each reduced over that lane
    const __m512d a = _mm512_castps_pd(s[2 * j]), b = _mm512_castps_pd(s[2 * j + 1]);
    t[j] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)  // lanes 0+1 and 2+3 of t[2j], then of t[2j+1]
    u[j] = op(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88), _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xDD));
  return op(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

// The 16 horizontal float sums of v[0..16) as one register.
static inline __m512 hsum16(const __m512* v) {
  return reduce16_lanes([v](int i) { return v[i]; }, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// The 16 horizontal maxima of v(0..16) (exact in any order where no lane is NaN).
template <typename Get>
static inline __m512 hmax16(Get v) {
  return reduce16_lanes(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

// The 16 horizontal int32 sums of v(0..16) (exact, wrapping as int32 adds do).
template <typename Get>
static inline __m512i hsum16_epi32(Get v) {
  return _mm512_castps_si512(reduce16_lanes([&v](int i) { return _mm512_castsi512_ps(v(i)); }, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
}
