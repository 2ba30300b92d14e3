// Vectorised exp shared by the compiled CPU kernels (cpu_attention.py, layer_ops.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// exp(x) (Cephes' single-precision polynomial, separate multiplies and adds), written once for one value (float),
// 8 (__m256, AVX2) or 16 (__m512, AVX-512) at a time: GCC's vector arithmetic gives each width the same operations
// in the same order, so the same bits. Only the clamp, the floor and the power of two differ by width. Inputs are
// clamped to [-87.3, 88]: below, exp(-87.3) (about 1e-38, nothing next to a softmax weight of 1); above, about 1.7e38.
static constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f, kLow = -87.33654f,
                      kHigh = 88.0f;
static constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                1.6666665459e-1f, 5.0000001201e-1f};

static inline float clamp_exp_arg(float x) { return std::min(std::max(x, kLow), kHigh); }
static inline float floor_lanes(float x) { return std::floor(x); }
static inline float pow2_lanes(float fx) {  // 2^fx for an integral fx, built from its exponent bits
  const int32_t bits = ((int32_t)fx + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, 4);
  return pow2;
}
#if defined(__AVX512F__)
static inline __m512 clamp_exp_arg(__m512 x) {
  return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
}
static inline __m512 floor_lanes(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline __m512 pow2_lanes(__m512 fx) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define DI_VEXP_AVX2 1
static inline __m256 clamp_exp_arg(__m256 x) {
  return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
}
static inline __m256 floor_lanes(__m256 x) { return _mm256_floor_ps(x); }
static inline __m256 pow2_lanes(__m256 fx) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23));
}
#endif

template <typename V>
static inline V exp_lanes(V x) {
  x = clamp_exp_arg(x);
  const V fx = floor_lanes(x * kLog2e + 0.5f);
  V r = x - fx * kC1;
  r = r - fx * kC2;
  const V z = r * r;
  V y = r * kP[0] + kP[1];
  for (int k = 2; k < 6; ++k) y = y * r + kP[k];
  y = y * z + r + 1.0f;
  return y * pow2_lanes(fx);
}

static inline float exp_approx(float x) { return exp_lanes(x); }

// v[0..count) = exp_approx(v[i] - shift)
static inline void exp_shifted(float* v, int64_t count, float shift) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + i), _mm512_set1_ps(shift));
    _mm512_mask_storeu_ps(v + i, m, exp_lanes(x));
  }
#else
  int64_t i = 0;
#if defined(DI_VEXP_AVX2)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(v + i, exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(shift))));
#endif
  for (; i < count; ++i) v[i] = exp_approx(v[i] - shift);
#endif
}
