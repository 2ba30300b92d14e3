// Greedy sampling's reduction: the argmax of each row of [N, V] float32 logits, as torch.argmax defines it (the
// first index of the largest value; a row holding NaN gives its first NaN), rows shared by the threads.
#include "aten.h"
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "ops.h"

static int64_t argmax_row(const float* x, int64_t V) {
  int64_t i = 0, first = 0;  // the next index to look at, the argmax so far
  float value = -INFINITY;
#if defined(__AVX512F__)
  if (V >= 16 && V < (int64_t)1 << 31) {  // 16 values at a time, lane j keeping the first index of its largest
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), where = at;
    __mmask16 nan = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly greater: earlier indices win ties
      best = _mm512_mask_mov_ps(best, gt, v);
      where = _mm512_mask_mov_epi32(where, gt, at);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
    }
    if (nan != 0) i = 0;  // the first NaN wins: the loop below finds it
    else {
      value = _mm512_reduce_max_ps(best);
      first = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(value), _CMP_EQ_OQ), where);
    }
  }
#endif
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > value) {
      value = x[i];
      first = i;
    }
  }
  return first;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) > 0,
              "argmax_rows: float32 [N, V] with V > 0");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto out = torch::empty({N}, torch::TensorOptions().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) op[n] = argmax_row(xp + n * V, V);
  });
  return out;
}
