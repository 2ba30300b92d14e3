// The AVX2 segment step of attention.cpp (CPUs without AVX-512; included by attention.cpp only).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kv_fp8.h"
#include "vexp.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define DI_ATTN_AVX2 1
#include <immintrin.h>

// softmax_segment with the maximum and the sum taken 8 scores at a time (then the tail one by one).
static inline float softmax_segment8(float* __restrict__ sg, int64_t count, float& row_max, float& row_sum) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sg + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float block_max = _mm_cvtss_f32(m4);
  for (int64_t j = i; j < count; ++j) block_max = std::max(block_max, sg[j]);
  const float new_max = std::max(row_max, block_max);
  const float rescale = std::exp(row_max - new_max);
  row_max = new_max;
  exp_shifted(sg, count, new_max);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j + 8 <= count; j += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(sg + j));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
  float total = _mm_cvtss_f32(s4);
  for (int64_t j = i; j < count; ++j) total += sg[j];
  row_sum = row_sum * rescale + total;
  return rescale;
}

// One cached row chunk of 8 values as float32 (a bfloat16 chunk widened on the way in).
static inline __m256 load8_kv(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_kv(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
static inline __m256 load8_kv(const uint8_t* p) { return fp8_widen8(p); }

// The 4 horizontal sums of v[0..4) (8 lanes each) as one 128-bit register, one fixed tree per register.
static inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// block_step for AVX2: keys KEYS at a time (4, 2 or 1: the G x KEYS partial-product registers fit the 16), each key
// chunk of 8 widened once for all G query heads (bfloat16 widening per head had cost as much as the FMAs), a head's
// chunk products summed in order and then by one hsum4 per head into scores (a key's tree does not depend on the
// others', so the bits are those of 4 keys at a time; and a head's arithmetic does not depend on the group: an item
// per query head gives the bits of an item per KV head); values CC chunks of 8 dimensions at a time with the G x CC
// accumulators in registers (below).
template <int DIM, int GROUP, typename KV>
static inline void block_step_avx2(const float* __restrict__ qh, const KV* __restrict__ kb, const KV* __restrict__ vb,
                                   int64_t count, int64_t stride, int64_t block_size, float scale,
                                   float* __restrict__ scores, float* __restrict__ acc, float* __restrict__ row_max,
                                   float* __restrict__ row_sum) {
  constexpr int C = DIM / 8;
  constexpr int KEYS = GROUP <= 3 ? 4 : GROUP <= 6 ? 2 : 1;
  for (int64_t i0 = 0; i0 < count; i0 += KEYS) {
    const int n = (int)std::min<int64_t>(KEYS, count - i0);
    __m256 part[GROUP][KEYS];
    for (int i = 0; i < KEYS; ++i) {
      if (i < n) {
        const KV* k = kb + (i0 + i) * stride;
        // into L1: this key's value row (read below) and the key row KEYS on (read next; both were asked into L2 a
        // block ahead)
        const char* v = reinterpret_cast<const char*>(vb + (i0 + i) * stride);
        const char* later = reinterpret_cast<const char*>(k + KEYS * stride);
        for (int line = 0; line < DIM * (int)sizeof(KV); line += 64) {
          _mm_prefetch(v + line, _MM_HINT_T0);
          if (i0 + KEYS + i < count) _mm_prefetch(later + line, _MM_HINT_T0);
        }
        const __m256 k0 = load8_kv(k);
        for (int g = 0; g < GROUP; ++g) part[g][i] = _mm256_mul_ps(_mm256_loadu_ps(qh + g * DIM), k0);
        for (int c = 1; c < C; ++c) {
          const __m256 kc = load8_kv(k + 8 * c);
          for (int g = 0; g < GROUP; ++g)
            part[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * DIM + 8 * c), kc, part[g][i]);
        }
      } else {
        for (int g = 0; g < GROUP; ++g) part[g][i] = _mm256_setzero_ps();
      }
    }
    for (int g = 0; g < GROUP; ++g) {
      __m256 four_keys[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int i = 0; i < KEYS; ++i) four_keys[i] = part[g][i];
      alignas(16) float four[4];
      _mm_store_ps(four, _mm_mul_ps(hsum4(four_keys[0], four_keys[1], four_keys[2], four_keys[3]), _mm_set1_ps(scale)));
      for (int i = 0; i < n; ++i) scores[g * block_size + i0 + i] = four[i];
    }
  }
  float rescale[GROUP];  // one rescale per segment
  for (int g = 0; g < GROUP; ++g) rescale[g] = softmax_segment8(scores + g * block_size, count, row_max[g], row_sum[g]);
  // CC chunks at a time: G x CC accumulators, 8 independent FMA chains (one chain per chunk had each key wait on the
  // last one's FMA); each (head, chunk) still sums the keys in order, so the bits do not change
  constexpr int CC = GROUP >= 8 ? 1 : (8 / GROUP < C ? 8 / GROUP : C);
  static_assert(C % CC == 0, "the head dimension's chunks split evenly");
  for (int c0 = 0; c0 < C; c0 += CC) {
    __m256 av[GROUP][CC];
    for (int g = 0; g < GROUP; ++g)
      for (int c = 0; c < CC; ++c)
        av[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * DIM + 8 * (c0 + c)), _mm256_set1_ps(rescale[g]));
    for (int64_t i = 0; i < count; ++i) {
      __m256 p[GROUP];
      for (int g = 0; g < GROUP; ++g) p[g] = _mm256_set1_ps(scores[g * block_size + i]);
      for (int c = 0; c < CC; ++c) {
        const __m256 v = load8_kv(vb + i * stride + 8 * (c0 + c));
        for (int g = 0; g < GROUP; ++g) av[g][c] = _mm256_fmadd_ps(p[g], v, av[g][c]);
      }
    }
    for (int g = 0; g < GROUP; ++g)
      for (int c = 0; c < CC; ++c) _mm256_storeu_ps(acc + g * DIM + 8 * (c0 + c), av[g][c]);
  }
}
#endif
