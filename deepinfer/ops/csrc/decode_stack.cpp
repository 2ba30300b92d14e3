// DecodeStack (ops.h): a decode step's decoder layers in one call from Python and one parallel region.
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

// This thread's contiguous share of n items, as at::parallel_for cuts them.
inline std::pair<int64_t, int64_t> share(int64_t n) {
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  return {n * t / nt, n * (t + 1) / nt};
}

// A norm's float32 weights with its offset added (Gemma's 1 + w), as the rows read them.
inline std::vector<float> offset_weights(const torch::Tensor& weight, double offset) {
  const auto w = weight.contiguous();
  std::vector<float> wo(w.numel());
  for (int64_t j = 0; j < w.numel(); ++j) wo[j] = w.data_ptr<float>()[j] + (float)offset;
  return wo;
}

inline void add_bias(float* row, const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return;
  const float* b = bias->data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) row[i] += b[i];
}

}  // namespace

DecodeStack::DecodeStack(std::vector<Linear> linears, std::vector<torch::Tensor> norms, std::vector<double> eps,
                         std::vector<double> offsets, std::vector<int64_t> norm_index, std::vector<int64_t> windows,
                         std::vector<int64_t> groups, std::vector<int64_t> shape, double scale, int64_t act,
                         std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
                         std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                         bool tiles)
    : linears_(std::move(linears)), eps_(std::move(eps)), norm_index_(std::move(norm_index)),
      windows_(std::move(windows)), groups_(std::move(groups)), scale_(scale), act_(act), cos_(std::move(cos)),
      sin_(std::move(sin)), k_caches_(std::move(k_caches)), v_caches_(std::move(v_caches)), tiles_(tiles) {
  const size_t L = windows_.size();
  TORCH_CHECK(L > 0 && linears_.size() == 4 * L && norm_index_.size() == kNorms * L + 1 && groups_.size() == L &&
              cos_.size() == L && sin_.size() == L && k_caches_.size() == L && v_caches_.size() == L &&
              eps_.size() == norms.size() && offsets.size() == norms.size() && shape.size() == 3,
              "DecodeStack: per-layer arguments do not match");
  heads_ = shape[0];
  kv_heads_ = shape[1];
  head_dim_ = shape[2];
  for (size_t i = 0; i < norms.size(); ++i) {
    TORCH_CHECK(norms[i].scalar_type() == torch::kFloat, "DecodeStack: norm weights must be float32");
    wo_.push_back(offset_weights(norms[i], offsets[i]));
  }
  for (int64_t i : norm_index_) TORCH_CHECK(i >= -1 && i < (int64_t)wo_.size(), "DecodeStack: bad norm index");
  TORCH_CHECK(norm_index_.back() >= 0, "DecodeStack: the final norm is required");
  const int64_t H = (int64_t)wo_[norm_index_.back()].size(), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_;
  for (size_t l = 0; l < L; ++l) {
    TORCH_CHECK(norm(l, kIn) && norm(l, kPreFfn), "DecodeStack: layer ", l, " needs its input and pre-FFN norms");
    for (int n = 0; n < kNorms; ++n) {
      const int64_t i = norm_index_[kNorms * l + n];
      TORCH_CHECK(i < 0 || (int64_t)wo_[i].size() == (n == kQ || n == kK ? head_dim_ : H),
                  "DecodeStack: layer ", l, " norm ", n, " has the wrong width");
    }
    TORCH_CHECK(std::get<6>(linears_[4 * l]) == qs + 2 * kvs && std::get<6>(linears_[4 * l + 1]) == H &&
                std::get<6>(linears_[4 * l + 3]) == H, "DecodeStack: layer ", l, " shapes do not match");
    TORCH_CHECK(cos_[l].scalar_type() == torch::kFloat && cos_[l].is_contiguous() && sin_[l].is_contiguous() &&
                2 * cos_[l].size(1) <= head_dim_ && sin_[l].sizes() == cos_[l].sizes(), "DecodeStack: bad rotary tables");
    max_positions_ = l == 0 ? cos_[l].size(0) : std::min(max_positions_, cos_[l].size(0));
    const auto& kc = k_caches_[l];
    const auto& vc = v_caches_[l];
    kv_kind(kc);  // a dtype the kernels read, or it throws
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == vc.scalar_type() && kc.dim() == 3 &&
                kc.size(1) == kv_heads_ && kc.size(2) == head_dim_ && vc.sizes() == kc.sizes(),
                "DecodeStack: KV caches must be one dtype, [slots, kv_heads, head_dim]");
  }
  for (size_t i = 0; i < linears_.size(); ++i) {
    const auto& w = linears_[i];
    const int64_t k = i % 4 == 0 || i % 4 == 2 ? H : i % 4 == 1 ? qs : std::get<6>(linears_[i - 1]) / 2;
    views_.push_back(quant_view(std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w), std::get<4>(w),
                                std::get<5>(w), k));
    const auto& b = std::get<7>(w);
    TORCH_CHECK(!b.has_value() || !b->defined() || (b->scalar_type() == torch::kFloat && b->is_contiguous()),
                "DecodeStack: biases must be contiguous float32");
  }
}

void DecodeStack::set_input(std::vector<torch::Tensor> norms, std::vector<double> eps, std::vector<double> offsets,
                            Linear eh) {
  const int64_t H = (int64_t)wo_[norm_index_.back()].size();
  TORCH_CHECK(windows_.size() == 1 && norms.size() == 2 && eps.size() == 2 && offsets.size() == 2,
              "DecodeStack: an input stage is for a one-layer stack, with two norms");
  TORCH_CHECK(std::get<6>(eh) == H, "DecodeStack: W_eh must have ", H, " output features");
  in_wo_.clear();
  for (size_t i = 0; i < 2; ++i) {
    TORCH_CHECK(norms[i].scalar_type() == torch::kFloat && norms[i].numel() == H,
                "DecodeStack: input norms must be float32 [", H, "]");
    in_wo_.push_back(offset_weights(norms[i], offsets[i]));
  }
  const auto& b = std::get<7>(eh);
  TORCH_CHECK(!b.has_value() || !b->defined() || (b->scalar_type() == torch::kFloat && b->is_contiguous()),
              "DecodeStack: biases must be contiguous float32");
  in_eps_ = std::move(eps);
  in_view_ = {quant_view(std::get<0>(eh), std::get<1>(eh), std::get<2>(eh), std::get<3>(eh), std::get<4>(eh),
                         std::get<5>(eh), 2 * H)};
  in_linear_ = {std::move(eh)};
}

const float* DecodeStack::norm(size_t layer, Norm which) const {
  const int64_t i = norm_index_[kNorms * layer + which];
  return i < 0 ? nullptr : wo_[i].data();
}

float DecodeStack::eps(size_t layer, Norm which) const {
  const int64_t i = norm_index_[kNorms * layer + which];
  return i < 0 ? 0.f : (float)eps_[i];
}

// Rows P..T-1 (prompt rows) as runs of consecutive positions of one sequence: row n + 1 continues row n's run where
// its position is the next one and its table starts with the same blocks.
static std::vector<AmxAttnRun> prompt_runs(const torch::Tensor& tables, const torch::Tensor& lens, int64_t P,
                                           int64_t T, int64_t block_size) {
  const int64_t *tb = tables.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>(), width = tables.size(1);
  std::vector<AmxAttnRun> runs;
  for (int64_t n = P; n < T; ++n) {
    const int64_t* row = tb + n * width;
    if (!runs.empty()) {
      AmxAttnRun& r = runs.back();
      const int64_t blocks = (ln[n] + block_size - 1) / block_size;
      if (ln[n] == r.pos0 + r.count + 1 && std::equal(row, row + blocks, r.table)) {
        ++r.count;
        r.table = row;  // the last row's table covers every row's blocks
        continue;
      }
    }
    AmxAttnRun r;
    r.row0 = n, r.count = 1, r.pos0 = ln[n] - 1, r.table = row;
    runs.push_back(r);
  }
  return runs;
}

torch::Tensor DecodeStack::forward(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> slots,
                                   std::vector<torch::Tensor> tables, std::vector<torch::Tensor> lens,
                                   int64_t block_size, int64_t tile_from, c10::optional<torch::Tensor> hidden,
                                   int64_t full_rows) const {
  const size_t L = windows_.size(), G = slots.size();
  const int64_t final_norm = norm_index_.back(), H = (int64_t)wo_[final_norm].size();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) == H, "DecodeStack: x must be float32 [T, ", H, "]");
  TORCH_CHECK(G > 0 && tables.size() == G && lens.size() == G && block_size > 0, "DecodeStack: one slot mapping, "
              "table and length tensor per group");
  x = x.contiguous();
  const int64_t T0 = x.size(0), P = tile_from < 0 || tile_from > T0 ? T0 : tile_from;  // rows P.. on the tiles
  TORCH_CHECK(P == T0 || (tiles_ && amx_ready()), "DecodeStack: rows for AMX tiles in a stack made without them "
              "or without AMX tile state");
  positions = positions.contiguous().to(torch::kLong);
  const int64_t T = x.size(0), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_, D = head_dim_;
  const bool staged = hidden.has_value() && hidden->defined();  // the MTP input stage first
  TORCH_CHECK(!staged || !in_view_.empty(), "DecodeStack: hidden states given to a stack without an input stage");
  if (staged) {
    hidden = hidden->contiguous();
    TORCH_CHECK(hidden->scalar_type() == torch::kFloat && hidden->dim() == 2 && hidden->size(0) == T &&
                hidden->size(1) == H, "DecodeStack: hidden must be float32 [T, ", H, "]");
  }
  const int64_t F = full_rows < 0 ? T : full_rows;  // rows F.. stop after their K and V
  TORCH_CHECK(F >= 0 && F <= T && (F == T || (L == 1 && P == T0)), "DecodeStack: full_rows must be in [0, T], and "
              "below T only for one layer on the blocks");
  TORCH_CHECK(positions.numel() == T, "DecodeStack: one position per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions_, "DecodeStack: position out of range");
  std::vector<int64_t> num_slots(G, INT64_MAX);
  for (size_t l = 0; l < L; ++l) {
    TORCH_CHECK(groups_[l] >= 0 && groups_[l] < (int64_t)G, "DecodeStack: layer ", l, " has no group tables");
    num_slots[groups_[l]] = std::min(num_slots[groups_[l]], k_caches_[l].size(0));
  }
  // Everything the region reads is checked here: nothing inside it may throw.
  for (size_t g = 0; g < G; ++g) {
    slots[g] = slots[g].contiguous().to(torch::kLong);
    tables[g] = tables[g].contiguous().to(torch::kLong);
    lens[g] = lens[g].contiguous().to(torch::kLong);
    TORCH_CHECK(slots[g].numel() == T && lens[g].numel() == T && tables[g].dim() == 2 && tables[g].size(0) == T,
                "DecodeStack: one slot, length and table per row");
    const int64_t *sl = slots[g].data_ptr<int64_t>(), *ln = lens[g].data_ptr<int64_t>();
    const int64_t *tb = tables[g].data_ptr<int64_t>(), width = tables[g].size(1), S = num_slots[g];
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "DecodeStack: slot out of range");
      TORCH_CHECK(ln[t] >= 1 && ln[t] <= width * block_size, "DecodeStack: context length out of range");
      for (int64_t b = 0; b < (ln[t] + block_size - 1) / block_size; ++b)
        TORCH_CHECK(tb[t * width + b] >= 0 && (tb[t * width + b] + 1) * block_size <= S,
                    "DecodeStack: block out of range");
    }
  }
  const int64_t ld_qkv = views_[0].nb * 16, ld_o = views_[1].nb * 16, ld_gu = views_[2].nb * 16;
  const int64_t ld_dn = views_[3].nb * 16, I = std::get<6>(linears_[2]) / 2;
  const int64_t kmax = std::max({staged ? 2 * H : H, qs, I});
  auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  auto res = staged ? torch::empty({T, H}, f32) : x.clone();
  const int64_t ld_eh = staged ? in_view_[0].nb * 16 : 0;
  auto cat = torch::empty({staged ? T : 0, 2 * H}, f32), xe = torch::empty({staged ? T : 0, ld_eh}, f32);
  auto h = torch::empty({T, H}, f32), tmp = torch::empty({T, H}, f32);
  auto qkv = torch::empty({T, ld_qkv}, f32), qc = torch::empty({T, qs}, f32), att = torch::empty({T, qs}, f32);
  auto o = torch::empty({T, ld_o}, f32), gu = torch::empty({T, ld_gu}, f32), a = torch::empty({T, I}, f32);
  auto dn = torch::empty({T, ld_dn}, f32);
  std::vector<int8_t> xq(T * kmax);
  std::vector<float> xd(T * kmax / 32);
  std::vector<int32_t> xs(T * kmax / 16);
  std::vector<float> xt(T * 3 * kmax / 32);
  const int64_t TM = T - P;  // rows on the tiles: bfloat16, zeros up to a multiple of 16
  std::vector<uint16_t> xb(TM > 0 ? ((TM + 15) / 16 * 16) * kmax : 0, 0);
  const int threads = at::get_num_threads();
  std::vector<DecodeAttention> plans;
  std::vector<AmxAttention> tile_plans;  // per layer where its prompt rows (P..) attend on AMX tiles, else empty
  std::vector<std::vector<AmxAttnRun>> group_runs(G);  // the prompt rows' sequences, per group of tables: once
  int64_t scratch = 0, room = 0;
  for (size_t l = 0; l < L; ++l) {
    const auto g = groups_[l];
    const bool tiled = TM > 0 && amx_attention_built() && k_caches_[l].scalar_type() == torch::kBFloat16;
    plans.push_back(decode_attention(qc.data_ptr<float>(), k_caches_[l], v_caches_[l], tiled ? P : F, heads_,
                                     tables[g].data_ptr<int64_t>(), tables[g].size(1), lens[g].data_ptr<int64_t>(),
                                     block_size, scale_, windows_[l], att.data_ptr<float>(), threads));
    scratch = std::max(scratch, decode_scratch(plans.back()));
    tile_plans.emplace_back();
    if (tiled) {
      if (group_runs[g].empty()) group_runs[g] = prompt_runs(tables[g], lens[g], P, T, block_size);
      tile_plans.back() = amx_attention_plan(qc.data_ptr<float>(), qs, k_caches_[l], v_caches_[l], heads_,
                                             group_runs[g], block_size, scale_,
                                             windows_[l], att.data_ptr<float>(), qs);
      room = std::max(room, tile_plans.back().room);
    }
  }
  std::vector<uint16_t> tile_room(room > 0 ? room + 32 : 0);  // one room for every layer's prepared tiles, in turn
  for (AmxAttention& a : tile_plans) a.tiles = room > 0 ? amx_aligned64(tile_room.data()) : nullptr;
  // whole cache lines per thread: a line shared by two threads' scratch (one's running max and sum, the other's
  // scores) went back and forth between the cores on every block
  scratch = (scratch + 15) / 16 * 16;
  std::vector<float> scratch_all(scratch * threads + 16);
  float* scratch_base = scratch_all.data() + (16 - (reinterpret_cast<uintptr_t>(scratch_all.data()) / 4) % 16) % 16;
  float *rp = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *tp = tmp.data_ptr<float>();
  float *qkvp = qkv.data_ptr<float>(), *qcp = qc.data_ptr<float>(), *attp = att.data_ptr<float>();
  float *op = o.data_ptr<float>(), *gup = gu.data_ptr<float>(), *ap = a.data_ptr<float>(), *dnp = dn.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* hsp = staged ? hidden->data_ptr<float>() : nullptr;
  float *catp = cat.data_ptr<float>(), *xep = xe.data_ptr<float>();
  int8_t* xqp = xq.data();
  float* xdp = xd.data();
  int32_t* xsp = xs.data();
  float* xtp = xt.data();
  uint16_t* xbp = xb.data();
  auto quantize = [&](const float* row, int64_t t, int64_t K) {
    if (t >= P) amx_round_row(row, K, xbp + (t - P) * K);
    else quantize_row(row, K, xqp + t * K, xdp + t * (K / 32), xsp + t * (K / 16), xtp + t * (3 * K / 32));
  };
  auto view_blocks = [&](const QuantView& view, float* out, int64_t ld, int64_t rows) {  // rows <= P
    const auto [b0, b1] = share(view.nb);
    if (rows > 0) quant_blocks(view, xqp, xdp, xsp, xtp, rows, out, ld, b0, b1);
  };
  auto blocks = [&](size_t i, float* out, int64_t ld, int64_t rows) {
    view_blocks(views_[i], out, ld, std::min(P, rows));
    if (TM > 0) {  // whole tiles of columns: ld is the padded width
      const int64_t nb = views_[i].nb, K = views_[i].k;
      const auto [i0, i1] = share(amx_num_items(TM, nb, K));
      amx_items(xbp, views_[i], out + P * ld, ld, TM, nb * 16, K, nullptr, i0, i1);
    }
  };
  // src (+ bias), normed by `post` if the layer has that norm, is added to res; h = next(res), rounded for the
  // next linear layer unless it is the output. An orphaned worksharing loop: its rows are shared by the threads of
  // the region it is called in.
  auto residual_norm = [&](float* src, int64_t ld, size_t lin, size_t l, Norm post, const float* next,
                           float next_eps, bool quantize_after) {
    const float* wp = norm(l, post);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < F; ++t) {
      float* row = src + t * ld;
      add_bias(row, std::get<7>(linears_[lin]), H);
      if (wp != nullptr) {
        rms_norm_row(row, nullptr, wp, H, eps(l, post), tp + t * H);
        row = tp + t * H;
      }
      rms_norm_row(row, rp + t * H, next, H, next_eps, hp + t * H);
      if (quantize_after) quantize(hp + t * H, t, H);
    }
  };

#pragma omp parallel num_threads(threads)
  {
    float* my_scratch = scratch_base + scratch * omp_get_thread_num();
    if (TM > 0) amx_configure();
    if (staged) {  // x = W_eh [enorm(x) ; hnorm(hidden)] (+ b): the layer's input and its residual
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        rms_norm_row(xp + t * H, nullptr, in_wo_[0].data(), H, (float)in_eps_[0], catp + t * 2 * H);
        rms_norm_row(hsp + t * H, nullptr, in_wo_[1].data(), H, (float)in_eps_[1], catp + t * 2 * H + H);
        quantize(catp + t * 2 * H, t, 2 * H);
      }
      view_blocks(in_view_[0], xep, ld_eh, T);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        add_bias(xep + t * ld_eh, std::get<7>(in_linear_[0]), H);
        std::memcpy(rp + t * H, xep + t * ld_eh, H * sizeof(float));
      }
    }
    const float* first = staged ? rp : xp;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      rms_norm_row(first + t * H, nullptr, norm(0, kIn), H, eps(0, kIn), hp + t * H);
      quantize(hp + t * H, t, H);
    }
    for (size_t l = 0; l < L; ++l) {
      const size_t w = 4 * l;
      const auto g = groups_[l];
      const int64_t* sl = slots[g].data_ptr<int64_t>();
      const float *cp = cos_[l].data_ptr<float>(), *sp = sin_[l].data_ptr<float>(), *qn = norm(l, kQ), *kn = norm(l, kK);
      const int64_t half = cos_[l].size(1);
      blocks(w, qkvp, ld_qkv, T);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        float* r = qkvp + t * ld_qkv;
        add_bias(r, std::get<7>(linears_[w]), qs + 2 * kvs);
        if (qn != nullptr)
          for (int64_t i = 0; i < heads_; ++i) rms_norm_row(r + i * D, nullptr, qn, D, eps(l, kQ), r + i * D);
        if (kn != nullptr)
          for (int64_t i = 0; i < kv_heads_; ++i) rms_norm_row(r + qs + i * D, nullptr, kn, D, eps(l, kK), r + qs + i * D);
        rotary_row(r, heads_, D, cp + pos[t] * half, sp + pos[t] * half, half);
        rotary_row(r + qs, kv_heads_, D, cp + pos[t] * half, sp + pos[t] * half, half);
        cache_row(r + qs, r + qs + kvs, k_caches_[l].data_ptr(), v_caches_[l].data_ptr(), plans[l].kind, sl[t],
                  kvs, kvs);
        std::memcpy(qcp + t * qs, r, qs * sizeof(float));
      }
      {  // this thread's contiguous range of items in one call: each item's last block asks for the next one's first
        const auto [i0, i1] = share(decode_items(plans[l]));
        decode_item_range(plans[l], i0, i1, my_scratch);
      }
      if (tile_plans[l].items > 0) {  // prompt rows: their keys and values as tiles, then their queries
        const auto [j0, j1] = share(tile_plans[l].prep_items);
        amx_attention_prepare(tile_plans[l], j0, j1);
#pragma omp barrier
        const auto [k0, k1] = share(tile_plans[l].items);
        amx_attention_items(tile_plans[l], k0, k1);
      }
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < F; ++t) quantize(attp + t * qs, t, qs);
      blocks(w + 1, op, ld_o, F);
#pragma omp barrier
      residual_norm(op, ld_o, w + 1, l, kPostAttn, norm(l, kPreFfn), eps(l, kPreFfn), true);
      blocks(w + 2, gup, ld_gu, F);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < F; ++t) {
        float* r = gup + t * ld_gu;
        add_bias(r, std::get<7>(linears_[w + 2]), 2 * I);
        act_row(r, r + I, ap + t * I, I, act_);
        quantize(ap + t * I, t, I);
      }
      blocks(w + 3, dnp, ld_dn, F);
#pragma omp barrier
      const bool last = l + 1 == L;
      residual_norm(dnp, ld_dn, w + 3, l, kPostFfn, last ? wo_[final_norm].data() : norm(l + 1, kIn),
                    last ? (float)eps_[final_norm] : eps(l + 1, kIn), !last);
    }
    if (TM > 0) amx_release();
  }
  return F == T ? h : h.narrow(0, 0, F);
}
