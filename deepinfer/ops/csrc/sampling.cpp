// Greedy sampling's reduction: the argmax of each row of [N, V] float32 logits, as torch.argmax defines it (the
// first index of the largest value; a row holding NaN gives its first NaN), rows shared by the threads.
#include "aten.h"
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
