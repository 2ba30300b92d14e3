// Vectorised exp shared by the compiled CPU kernels (cpu_attention.py, layer_ops.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// exp(x) (Cephes' single-precision polynomial, separate multiplies and adds), 16 values at a time where the CPU has
// AVX-512 and one at a time otherwise, with the same operations in the same order: the same bits. Inputs are clamped
// to [-87.3, 88]: below, exp(-87.3) (about 1e-38, nothing next to a softmax weight of 1); above, about 1.7e38.
static constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f, kLow = -87.33654f,
                      kHigh = 88.0f;
static constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_approx(float x) {
  x = std::min(std::max(x, kLow), kHigh);
  const float fx = std::floor(x * kLog2e + 0.5f);
  float r = x - fx * kC1;
  r = r - fx * kC2;
  const float z = r * r;
  float y = kP[0];
  for (int i = 1; i < 6; ++i) y = y * r + kP[i];
  y = y * z + r + 1.0f;
  const int32_t bits = ((int32_t)fx + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, 4);
  return y * pow2;
}

#if defined(__AVX512F__)
static inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
  const __m512 fx = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(kC1)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(fx, _mm512_set1_ps(kC2)));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(kP[0]);
  for (int k = 1; k < 6; ++k) y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(kP[k]));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp_approx8(__m256 x) {  // exp_approx16's operations, 8 values at a time
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(kC1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(kC2)));
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_set1_ps(kP[0]);
  for (int k = 1; k < 6; ++k) y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(kP[k]));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// v[0..count) = exp_approx(v[i] - shift)
static inline void exp_shifted(float* v, int64_t count, float shift) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + i), _mm512_set1_ps(shift));
    _mm512_mask_storeu_ps(v + i, m, exp_approx16(x));
  }
#else
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(v + i, exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(shift))));
#endif
  for (; i < count; ++i) v[i] = exp_approx(v[i] - shift);
#endif
}
