// The greedy token of each row straight from an LM head on block-quantized weights: the argmax over the n outputs
// of x @ dequant(W)^T, what argmax_rows(quant_linear(x, W)) gives, without writing the [M, n] logits out and
// reading them back (Gemma 3's rows are 262,144 columns, 1 MB each). Each thread computes a contiguous range of
// 16-column blocks, a few at a time into a buffer that stays in cache, and scans them as they come (ArgmaxScan);
// the threads' answers are then combined in column order: the first NaN wins, else the largest value, earlier
// columns winning ties. The values are quant_blocks' own, so the index is the one the two ops give.
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "argmax_scan.h"
#include "ops.h"

torch::Tensor quant_linear_argmax(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                                  int64_t bits, int64_t group, double c, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quant_linear_argmax: x must be float32 [M, K]");
  TORCH_CHECK(n > 0 && n < ((int64_t)1 << 31), "quant_linear_argmax: 0 < n < 2^31 outputs, got ", n);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const QuantView w = quant_view(quants, scales, offsets, bits, group, c, K);
  TORCH_CHECK(n <= w.nb * 16, "quant_linear_argmax: n=", n, " exceeds the weight's ", w.nb * 16, " rows");
  auto out = torch::empty({M}, torch::TensorOptions().dtype(torch::kLong));
  if (M == 0) return out;
  const QuantActs a = quantize_acts(x);
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), w.nb));
  const int64_t pass = std::clamp<int64_t>(4096 / M, 1, 64);  // blocks per buffer: at most 256 KB of values
  std::vector<float> values(T * M);
  std::vector<int64_t> firsts(T * M);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(M * 16 * pass);
    std::vector<ArgmaxScan> scans(M);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(scans.begin(), scans.end(), ArgmaxScan());
      const int64_t b0 = t * w.nb / T, b1 = (t + 1) * w.nb / T;
      for (int64_t b = b0; b < b1 && 16 * b < n; b += pass) {
        const int64_t e = std::min(b + pass, b1), width = 16 * (e - b);
        quant_blocks(w, a.xq.data_ptr<int8_t>(), a.xd.data_ptr<float>(), a.xs.data_ptr<int32_t>(),
                     a.xt.data_ptr<float>(), M, buf.data(), width, b, e, b);
        const int64_t cols = std::min(width, n - 16 * b);  // columns past n are padding, not outputs
        for (int64_t m = 0; m < M; ++m) scans[m].feed(buf.data() + m * width, cols, 16 * b);
      }
      for (int64_t m = 0; m < M; ++m) firsts[t * M + m] = scans[m].finish(&values[t * M + m]);
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    int64_t best = 0;
    float value = -INFINITY;
    for (int64_t t = 0; t < T; ++t) {
      const float v = values[t * M + m];
      if (std::isnan(v)) {  // the first NaN: no earlier range held one
        best = firsts[t * M + m];
        break;
      }
      if (v > value) value = v, best = firsts[t * M + m];
    }
    op[m] = best;
  }
  return out;
}
