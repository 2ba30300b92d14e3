// Greedy sampling's reduction: the argmax of each row of [N, V] float32 logits, as torch.argmax defines it (the
// first index of the largest value; a row holding NaN gives its first NaN), rows shared by the threads.
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "argmax_scan.h"
#include "ops.h"

static int64_t argmax_row(const float* x, int64_t V) {
  ArgmaxScan scan;
  scan.feed(x, V, 0);
  float value;
  return scan.finish(&value);
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) > 0 && x.size(1) < ((int64_t)1 << 31),
              "argmax_rows: float32 [N, V] with 0 < V < 2^31");
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

// Seeded sampling's inverse CDF over token ids (no top-k / top-p), for the sampler's id-order rows: with w the row's
// weights (float32, >= 0), the cdf its float64 running sum from id 0 (the order torch's CPU cumsum adds in) and
// total the last entry, the first id whose cdf exceeds min(u * total, nextafter(total, 0)): what searchsorted
// (right=True) on the cumsum gives, without the [N, V] float64 cdf. -1 where total or the target is not finite
// (NaN weights): the caller decides those rows the torch way.
torch::Tensor sample_id_order(torch::Tensor weights, torch::Tensor u) {
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == torch::kFloat, "sample_id_order: float32 [N, V] weights");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == torch::kDouble && u.size(0) == weights.size(0),
              "sample_id_order: float64 [N] uniforms");
  weights = weights.contiguous();
  u = u.contiguous();
  const int64_t N = weights.size(0), V = weights.size(1);
  auto out = torch::empty({N}, torch::TensorOptions().dtype(torch::kLong));
  const float* wp = weights.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* w = wp + n * V;
      double total = 0.0;
      for (int64_t i = 0; i < V; ++i) total += (double)w[i];
      const double target = std::min(up[n] * total, std::nextafter(total, 0.0));
      int64_t pick = -1;
      if (std::isfinite(total) && std::isfinite(target)) {
        double cdf = 0.0;
        for (int64_t i = 0; i < V; ++i) {
          cdf += (double)w[i];
          if (cdf > target) {
            pick = i;
            break;
          }
        }
      }
      op[n] = pick;
    }
  });
  return out;
}
