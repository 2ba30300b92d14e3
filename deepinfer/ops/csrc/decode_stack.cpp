// DecodeStack (ops.h): a decode step's decoder layers in one call from Python and one parallel region.
#include <omp.h>

#include <cstring>

#include "ops.h"

namespace {

// Columns begin..end of this thread's share of `n` items (contiguous chunks, as at::parallel_for cuts them).
inline std::pair<int64_t, int64_t> share(int64_t n) {
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  return {n * t / nt, n * (t + 1) / nt};
}

inline void add_bias(float* row, const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return;
  const float* b = bias->data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) row[i] += b[i];
}

}  // namespace

DecodeStack::DecodeStack(std::vector<Linear> linears, std::vector<torch::Tensor> norms, std::vector<double> eps,
                         std::vector<int64_t> windows, std::vector<int64_t> shape, double scale, int64_t act,
                         torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                         std::vector<torch::Tensor> v_caches)
    : linears_(std::move(linears)), norms_(std::move(norms)), eps_(std::move(eps)), windows_(std::move(windows)),
      scale_(scale), act_(act), cos_(cos.contiguous()), sin_(sin.contiguous()), k_caches_(std::move(k_caches)),
      v_caches_(std::move(v_caches)) {
  const size_t layers = windows_.size();
  TORCH_CHECK(layers > 0 && linears_.size() == 4 * layers && norms_.size() == 2 * layers + 1 &&
              eps_.size() == norms_.size() && k_caches_.size() == layers && v_caches_.size() == layers &&
              shape.size() == 3, "DecodeStack: per-layer arguments do not match");
  heads_ = shape[0];
  kv_heads_ = shape[1];
  head_dim_ = shape[2];
  const int64_t H = norms_[0].numel(), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_;
  TORCH_CHECK(cos_.scalar_type() == torch::kFloat32 && 2 * cos_.size(1) <= head_dim_ && sin_.sizes() == cos_.sizes(),
              "DecodeStack: bad rotary tables");
  for (size_t i = 0; i < linears_.size(); ++i) {
    const auto& w = linears_[i];
    const int64_t k = i % 4 == 0 || i % 4 == 2 ? H : i % 4 == 1 ? qs : std::get<6>(linears_[i - 1]) / 2;
    views_.push_back(quant_view(std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w), std::get<4>(w),
                                std::get<5>(w), k));
    const auto& b = std::get<7>(w);
    TORCH_CHECK(!b.has_value() || !b->defined() || (b->scalar_type() == torch::kFloat32 && b->is_contiguous()),
                "DecodeStack: biases must be contiguous float32");
  }
  for (size_t l = 0; l < layers; ++l) {
    TORCH_CHECK(std::get<6>(linears_[4 * l]) == qs + 2 * kvs && std::get<6>(linears_[4 * l + 1]) == H &&
                std::get<6>(linears_[4 * l + 3]) == H, "DecodeStack: layer ", l, " shapes do not match");
    const auto& kc = k_caches_[l];
    const auto& vc = v_caches_[l];
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == vc.scalar_type() &&
                (kc.scalar_type() == torch::kFloat32 || kc.scalar_type() == torch::kBFloat16) && kc.dim() == 3 &&
                kc.size(1) == kv_heads_ && kc.size(2) == head_dim_ && vc.sizes() == kc.sizes(),
                "DecodeStack: KV caches must be float32 or bfloat16 [slots, kv_heads, head_dim]");
  }
  for (auto& n : norms_) {
    n = n.contiguous();
    TORCH_CHECK(n.scalar_type() == torch::kFloat32 && n.numel() == H, "DecodeStack: norm weights");
    std::vector<float> wo(H);
    for (int64_t i = 0; i < H; ++i) wo[i] = n.data_ptr<float>()[i] + 0.f;
    wo_.push_back(std::move(wo));
  }
}

torch::Tensor DecodeStack::forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots,
                                   torch::Tensor tables, torch::Tensor lens, int64_t block_size) const {
  const int64_t H = norms_[0].numel();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) == H, "DecodeStack: x must be float32 [T, ", H, "]");
  x = x.contiguous();
  positions = positions.contiguous().to(torch::kInt64);
  slots = slots.contiguous().to(torch::kInt64);
  tables = tables.contiguous().to(torch::kInt64);
  lens = lens.contiguous().to(torch::kInt64);
  const int64_t T = x.size(0), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_, D = head_dim_;
  TORCH_CHECK(positions.numel() == T && slots.numel() == T && lens.numel() == T && tables.dim() == 2 &&
              tables.size(0) == T && block_size > 0, "DecodeStack: one position, slot, length and table per row");
  // Everything the region reads is checked here: nothing inside it may throw.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1), num_slots = k_caches_[0].size(0);
  for (const auto& c : k_caches_) TORCH_CHECK(c.size(0) == num_slots, "DecodeStack: caches differ in size");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "DecodeStack: position out of range");
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "DecodeStack: slot out of range");
    TORCH_CHECK(ln[t] >= 1 && ln[t] <= width * block_size, "DecodeStack: context length out of range");
    for (int64_t b = 0; b < (ln[t] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tb[t * width + b] >= 0 && (tb[t * width + b] + 1) * block_size <= num_slots,
                  "DecodeStack: block out of range");
  }
  const size_t L = windows_.size();
  const int64_t ld_qkv = views_[0].nb * 16, ld_o = views_[1].nb * 16, ld_gu = views_[2].nb * 16;
  const int64_t ld_dn = views_[3].nb * 16, I = std::get<6>(linears_[2]) / 2;
  const int64_t kmax = std::max({H, qs, I});
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto res = x.clone();
  auto h = torch::empty({T, H}, f32);
  auto qkv = torch::empty({T, ld_qkv}, f32), qc = torch::empty({T, qs}, f32), att = torch::empty({T, qs}, f32);
  auto o = torch::empty({T, ld_o}, f32), gu = torch::empty({T, ld_gu}, f32), a = torch::empty({T, I}, f32);
  auto dn = torch::empty({T, ld_dn}, f32);
  std::vector<int8_t> xq(T * kmax);
  std::vector<float> xd(T * kmax / 32);
  std::vector<int32_t> xs(T * kmax / 16);
  const int threads = at::get_num_threads();
  std::vector<DecodeAttention> plans;
  int64_t scratch = 0;
  for (size_t l = 0; l < L; ++l) {
    plans.push_back(decode_attention(qc.data_ptr<float>(), k_caches_[l], v_caches_[l], T, heads_, tb, width, ln,
                                     block_size, scale_, windows_[l], att.data_ptr<float>(), threads));
    scratch = std::max(scratch, decode_scratch(plans.back()));
  }
  std::vector<float> scratch_all(scratch * threads);
  float *rp = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *qcp = qc.data_ptr<float>(), *attp = att.data_ptr<float>(), *op = o.data_ptr<float>();
  float *gup = gu.data_ptr<float>(), *ap = a.data_ptr<float>(), *dnp = dn.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *cp = cos_.data_ptr<float>(), *sp = sin_.data_ptr<float>();
  const int64_t half = cos_.size(1);
  int8_t* xqp = xq.data();
  float* xdp = xd.data();
  int32_t* xsp = xs.data();
  auto quantize = [&](const float* row, int64_t t, int64_t K) {
    quantize_row(row, K, xqp + t * K, xdp + t * (K / 32), xsp + t * (K / 16));
  };
  auto blocks = [&](size_t i, float* out, int64_t ld) {
    const auto [b0, b1] = share(views_[i].nb);
    quant_blocks(views_[i], xqp, xdp, xsp, T, out, ld, b0, b1);
  };
  // res += src (+ bias) row by row, h = norm(res), h rounded for the next linear layer unless it is the output.
  // An orphaned worksharing loop: called inside the region below, its rows are shared by the region's threads.
  auto residual_norm = [&](float* src, int64_t ld, size_t lin, size_t norm, bool quantize_after) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      add_bias(src + t * ld, std::get<7>(linears_[lin]), H);
      rms_norm_row(src + t * ld, rp + t * H, wo_[norm].data(), H, (float)eps_[norm], hp + t * H);
      if (quantize_after) quantize(hp + t * H, t, H);
    }
  };

#pragma omp parallel num_threads(threads)
  {
    float* my_scratch = scratch_all.data() + scratch * omp_get_thread_num();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      rms_norm_row(xp + t * H, nullptr, wo_[0].data(), H, (float)eps_[0], hp + t * H);
      quantize(hp + t * H, t, H);
    }
    for (size_t l = 0; l < L; ++l) {
      const size_t w = 4 * l;
      blocks(w, qkvp, ld_qkv);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        float* r = qkvp + t * ld_qkv;
        add_bias(r, std::get<7>(linears_[w]), qs + 2 * kvs);
        rotary_row(r, heads_, D, cp + pos[t] * half, sp + pos[t] * half, half);
        rotary_row(r + qs, kv_heads_, D, cp + pos[t] * half, sp + pos[t] * half, half);
        cache_row(r + qs, r + qs + kvs, k_caches_[l].data_ptr(), v_caches_[l].data_ptr(), plans[l].bf16, sl[t],
                  kvs, kvs);
        std::memcpy(qcp + t * qs, r, qs * sizeof(float));
      }
      const int64_t items = decode_items(plans[l]);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < items; ++i) decode_item_range(plans[l], i, i + 1, my_scratch);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) quantize(attp + t * qs, t, qs);
      blocks(w + 1, op, ld_o);
#pragma omp barrier
      residual_norm(op, ld_o, w + 1, 2 * l + 1, true);
      blocks(w + 2, gup, ld_gu);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        float* g = gup + t * ld_gu;
        add_bias(g, std::get<7>(linears_[w + 2]), 2 * I);
        act_row(g, g + I, ap + t * I, I, act_);
        quantize(ap + t * I, t, I);
      }
      blocks(w + 3, dnp, ld_dn);
#pragma omp barrier
      residual_norm(dnp, ld_dn, w + 3, 2 * l + 2, l + 1 < L);
    }
  }
  return h;
}
