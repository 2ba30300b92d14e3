// A running argmax of one row whose values arrive in runs, in index order, as torch.argmax defines it: the first
// index of the largest value; a row holding NaN gives its first NaN (a row of -inf gives 0). Used by argmax_rows
// (sampling.cpp: a whole row, one run) and by the LM head's fused argmax (head_argmax.cpp: a thread's columns, in
// runs as it computes them): the same rule either way.
#pragma once
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

struct ArgmaxScan {
#if defined(__AVX512F__)
  // lane j: the largest value so far among the indices it saw and the first index holding it; its first NaN
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), nan_at = where;
  __mmask16 nan = 0;

  // values x[0..len) at indices base..base+len-1 (below 2^31)
  void feed(const float* x, int64_t len, int64_t base) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
      const __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(base + i)), lane);
      const __mmask16 gt = _mm512_mask_cmp_ps_mask(k, v, best, _CMP_GT_OQ);  // strictly: earlier indices win ties
      best = _mm512_mask_mov_ps(best, gt, v);
      where = _mm512_mask_mov_epi32(where, gt, at);
      const __mmask16 fresh = _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q) & (__mmask16)~nan;
      nan_at = _mm512_mask_mov_epi32(nan_at, fresh, at);
      nan = (__mmask16)(nan | fresh);
    }
  }

  // the argmax; *value: the largest value (NaN when the row held one)
  int64_t finish(float* value) const {
    if (nan != 0) {
      *value = NAN;
      return _mm512_mask_reduce_min_epi32(nan, nan_at);
    }
    *value = _mm512_reduce_max_ps(best);
    return _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(*value), _CMP_EQ_OQ), where);
  }
#else
  float best = -INFINITY;
  int64_t where = 0, nan_at = -1;

  void feed(const float* x, int64_t len, int64_t base) {
    for (int64_t i = 0; i < len && nan_at < 0; ++i) {
      if (std::isnan(x[i])) nan_at = base + i;
      else if (x[i] > best) best = x[i], where = base + i;
    }
  }

  int64_t finish(float* value) const {
    *value = nan_at >= 0 ? NAN : best;
    return nan_at >= 0 ? nan_at : where;
  }
#endif
};
