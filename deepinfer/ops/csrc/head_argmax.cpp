// The greedy token of each row straight from an LM head on block-quantized weights: the argmax over the n outputs
// of x @ dequant(W)^T, what argmax_rows(quant_linear(x, W)) gives, without writing the [M, n] logits out and
// reading them back (Gemma 3's rows are 262,144 columns, 1 MB each). The loop is argmax_blocks.h's; the values are
// quant_blocks' own, so the index is the one the two ops give.
#include "aten.h"
#include <cstdint>

#include "argmax_blocks.h"
#include "ops.h"

torch::Tensor quant_linear_argmax(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                                  int64_t bits, int64_t group, double c, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quant_linear_argmax: x must be float32 [M, K]");
  TORCH_CHECK(n > 0 && n < ((int64_t)1 << 31), "quant_linear_argmax: 0 < n < 2^31 outputs, got ", n);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const QuantView w = quant_view(quants, scales, offsets, bits, group, c, K);
  TORCH_CHECK(n <= w.nb * 16, "quant_linear_argmax: n=", n, " exceeds the weight's ", w.nb * 16, " rows");
  if (M == 0) return torch::empty({0}, torch::TensorOptions().dtype(torch::kLong));
  const QuantActs a = quantize_acts(x);
  return argmax_over_blocks(M, w.nb, n, [&](float* buf, int64_t ldo, int64_t b, int64_t e) {
    quant_blocks(w, a.xq.data_ptr<int8_t>(), a.xd.data_ptr<float>(), a.xs.data_ptr<int32_t>(),
                 a.xt.data_ptr<float>(), M, buf, ldo, b, e, b);
  });
}
