// Greedy sampling's reduction: the argmax of each row of [N, V] float32 logits, as torch.argmax defines it (the
// first index of the largest value; a row holding NaN gives its first NaN), rows shared by the threads.
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// Rows w[0..R) (V floats apart): each row's float64 sum, added from id 0 on; R chains of dependent adds side by side
// (each row's own adds in its own order: the bits of one row alone), R x the throughput of one chain.
template <int R>
static inline void sums_of(const float* w, int64_t V, double* out) {
  double s[R] = {};
  for (int64_t i = 0; i < V; ++i)
    for (int r = 0; r < R; ++r) s[r] += (double)w[r * V + i];
  for (int r = 0; r < R; ++r) out[r] = s[r];
}

// For rows w[0..R) side by side: the first id whose running float64 sum exceeds target[r], or -1 (none, or a row
// that is not `live`); the scans go on until every live row has its id.
template <int R>
static inline void firsts_above(const float* w, int64_t V, const double* target, const bool* live, int64_t* pick) {
  double s[R] = {};
  int left = 0;
  for (int r = 0; r < R; ++r) {
    pick[r] = -1;
    left += live[r];
  }
  for (int64_t i = 0; i < V && left > 0; ++i)
    for (int r = 0; r < R; ++r) {
      s[r] += (double)w[r * V + i];
      if (live[r] && pick[r] < 0 && s[r] > target[r]) {
        pick[r] = i;
        --left;
      }
    }
}

// Seeded sampling's inverse CDF over token ids (no top-k / top-p), for the sampler's id-order rows: with w the row's
// weights (float32, >= 0), the cdf its float64 running sum from id 0 (the order torch's CPU cumsum adds in) and
// total the last entry, the first id whose cdf exceeds min(u * total, nextafter(total, 0)): what searchsorted
// (right=True) on the cumsum gives, without the [N, V] float64 cdf. -1 where total or the target is not finite
// (NaN weights): the caller decides those rows the torch way. Rows go four at a time side by side (sums_of,
// firsts_above).
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
  auto rows = [&](auto count, int64_t n) {  // rows n..n+R-1, side by side
    constexpr int R = decltype(count)::value;
    double total[R], target[R];
    bool live[R];
    sums_of<R>(wp + n * V, V, total);
    for (int r = 0; r < R; ++r) {
      target[r] = std::min(up[n + r] * total[r], std::nextafter(total[r], 0.0));
      live[r] = std::isfinite(total[r]) && std::isfinite(target[r]);
    }
    firsts_above<R>(wp + n * V, V, target, live, op + n);
  };
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) rows(std::integral_constant<int, 4>{}, n);
    for (; n < end; ++n) rows(std::integral_constant<int, 1>{}, n);
  });
  return out;
}

// torch.sort(x, dim=-1, descending=True, stable=True) of float32 [N, V] rows (values and ids), rows shared by the
// threads: a least-significant-digit radix sort (four passes of 8 bits, a pass skipped where every key shares its
// digit) of keys that order the floats as that sort does: NaNs first (tied with each other), then +inf down to
// -inf, -0 tied with +0; a radix sort is stable, so ties keep ascending ids, as the stable sort does. Linear in V:
// a whole row of SmolLM2's 49,152 sorts about ten times faster than torch's comparison sort.
static inline uint32_t descending_key(float v) {
  if (std::isnan(v)) return 0u;
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  if ((b & 0x7FFFFFFFu) == 0) b = 0;  // -0 as +0
  const uint32_t ascending = (b >> 31) ? ~b : (b | 0x80000000u);
  return ~ascending;
}

static void sort_row(const float* x, int64_t V, float* values, int64_t* ids, std::vector<uint64_t>& buffer) {
  buffer.resize(2 * (size_t)V);  // (key << 32 | id) entries: one 8-byte move per entry and pass
  uint64_t *a = buffer.data(), *b = a + V;
  uint32_t counts[4][256] = {};
  for (int64_t i = 0; i < V; ++i) {
    const uint32_t key = descending_key(x[i]);
    a[i] = (uint64_t)key << 32 | (uint64_t)i;
    for (int p = 0; p < 4; ++p) ++counts[p][(key >> (8 * p)) & 255];
  }
  for (int p = 0; p < 4; ++p) {
    const int shift = 32 + 8 * p;
    const uint32_t* c = counts[p];
    if (c[(a[0] >> shift) & 255] == (uint32_t)V) continue;  // one digit for all: the order stays
    uint32_t start[256], at = 0;
    for (int d = 0; d < 256; ++d) {
      start[d] = at;
      at += c[d];
    }
    for (int64_t i = 0; i < V; ++i) b[start[(a[i] >> shift) & 255]++] = a[i];
    std::swap(a, b);
  }
  for (int64_t i = 0; i < V; ++i) {
    const uint32_t id = (uint32_t)a[i];
    ids[i] = id;
    values[i] = x[id];
  }
}

std::tuple<torch::Tensor, torch::Tensor> sort_descending(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) < ((int64_t)1 << 31),
              "sort_descending: float32 [N, V] with V < 2^31");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto values = torch::empty({N, V}, x.options());
  auto ids = torch::empty({N, V}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  if (V > 0)
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> buffer;
      for (int64_t n = begin; n < end; ++n) sort_row(xp + n * V, V, vp + n * V, ip + n * V, buffer);
    });
  return {values, ids};
}

// The sampler's decision on rows in (logit descending, id ascending) order (sampler.py's _sample_sorted, the same
// float64 sums in the same order, without its [N, W] float64 cdf): with w the weights of a row's first W entries
// in that order (zero from `limit` on) and cdf their float64 running sum, total = cdf[min(max(top_k, 1), W) - 1]
// when top_k > 0, else id_total; kept = max(1, the entries whose preceding mass is below top_p x total); the pick
// is the first entry whose cdf exceeds min(u x cdf[kept - 1], nextafter(cdf[kept - 1], 0)), at most W - 1; the
// row is decided when `complete`, or top_k <= usable (top_k > 0), or cdf[W - 1] >= top_p x total. Returns (pick,
// decided); pick -1 where the weights hold NaN (the caller decides those rows the torch way). The cdf being
// non-decreasing there, counting and searching stop at the first entry that decides them.
std::tuple<torch::Tensor, torch::Tensor> sample_sorted(torch::Tensor weights, torch::Tensor limit, torch::Tensor top_k,
                                                       torch::Tensor top_p, torch::Tensor id_total, torch::Tensor u,
                                                       torch::Tensor usable, torch::Tensor complete) {
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == torch::kFloat, "sample_sorted: float32 [N, W] weights");
  const int64_t N = weights.size(0), W = weights.size(1);
  auto i64 = [&](torch::Tensor t) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == N && t.scalar_type() == torch::kLong, "sample_sorted: int64 [N]");
    return t.contiguous();
  };
  auto f64 = [&](torch::Tensor t) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == N && t.scalar_type() == torch::kDouble, "sample_sorted: float64 [N]");
    return t.contiguous();
  };
  TORCH_CHECK(W > 0 && complete.dim() == 1 && complete.size(0) == N && complete.scalar_type() == torch::kBool,
              "sample_sorted: W > 0 and bool [N] complete");
  weights = weights.contiguous();
  limit = i64(limit), top_k = i64(top_k), usable = i64(usable), complete = complete.contiguous();
  top_p = f64(top_p), id_total = f64(id_total), u = f64(u);
  auto pick = torch::empty({N}, torch::TensorOptions().dtype(torch::kLong));
  auto decided = torch::empty({N}, torch::TensorOptions().dtype(torch::kBool));
  const float* wp = weights.data_ptr<float>();
  const int64_t *lp = limit.data_ptr<int64_t>(), *kp = top_k.data_ptr<int64_t>(), *up = usable.data_ptr<int64_t>();
  const double *pp = top_p.data_ptr<double>(), *tp = id_total.data_ptr<double>(), *rp = u.data_ptr<double>();
  const bool* cp = complete.data_ptr<bool>();
  int64_t* out = pick.data_ptr<int64_t>();
  bool* dp = decided.data_ptr<bool>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* w = wp + n * W;
      const int64_t lim = std::min(lp[n], W), k = kp[n];
      auto weight = [&](int64_t j) { return (double)(j < lim ? w[j] : 0.f); };  // zero from `limit` on
      const int64_t kth = std::min(std::max<int64_t>(k, 1), W) - 1;
      double cdf = 0.0, top_k_total = 0.0;
      bool nan = false;
      for (int64_t j = 0; j < W; ++j) {  // the last entry, the k-th, and whether any weight is NaN
        const double x = weight(j);
        nan |= std::isnan(x);
        cdf += x;
        if (j == kth) top_k_total = cdf;
      }
      const double total = k > 0 ? top_k_total : tp[n], threshold = pp[n] * total;
      dp[n] = cp[n] || (k > 0 ? k <= up[n] : cdf >= threshold);
      if (nan) {
        out[n] = -1;
        continue;
      }
      int64_t kept = 0;  // entries whose preceding mass is below the threshold; `before` ends as cdf[kept - 1]
      double before = 0.0;
      while (kept < W && before < threshold) before += weight(kept++);
      const double kept_total = kept > 0 ? before : weight(0);  // at least one entry is kept
      const double target = std::min(rp[n] * kept_total, std::nextafter(kept_total, 0.0));
      int64_t at = 0;
      double run = 0.0;
      for (; at < W; ++at) {
        run += weight(at);
        if (run > target) break;
      }
      out[n] = std::min(at, W - 1);
    }
  });
  return {pick, decided};
}

// Each row's float64 sum, added from id 0 on: the last entry of torch's CPU cumsum of the row in float64 (the
// sequential sum the sampler's totals are), without the [N, V] float64 cdf.
torch::Tensor row_sums(torch::Tensor weights) {
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == torch::kFloat, "row_sums: float32 [N, V] weights");
  weights = weights.contiguous();
  const int64_t N = weights.size(0), V = weights.size(1);
  auto out = torch::empty({N}, torch::TensorOptions().dtype(torch::kDouble));
  const float* wp = weights.data_ptr<float>();
  double* op = out.data_ptr<double>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) sums_of<4>(wp + n * V, V, op + n);
    for (; n < end; ++n) sums_of<1>(wp + n * V, V, op + n);
  });
  return out;
}

// The first k entries of each row in (value descending, id ascending) order, as sort_descending orders them (NaN
// first, -0 tied with +0), without sorting the row: ids are scanned in ascending order, 16 keys at a time compared
// with the k-th best key so far (an entry tied with it comes later, so it is worse), the few that pass collected
// and cut back to the best k whenever 4k pile up. Returns (values [N, k], ids [N, k], usable [N], complete [N]) as
// logprobs.py's ordered_top defines them: usable = the entries above the k-th value (k when complete), complete =
// the k-th value is -inf or k == V. Where topk chooses among entries tied with the k-th, this takes the lowest ids;
// the sampler reads only the usable entries, so its tokens are the same.
static void top_row(const float* x, int64_t V, int64_t k, float* values, int64_t* ids, std::vector<uint64_t>& kept) {
  const size_t cap = 4 * (size_t)k;
  kept.clear();
  // Entries must have a key below `bound`: the k-th best key once k are kept; before that 0xFFFFFFFF, which no key
  // reaches (the largest, -inf's, is 0xFF800000), so every entry passes.
  uint32_t bound = 0xFFFFFFFFu;
  auto keep = [&](uint32_t key, int64_t i) {
    kept.push_back((uint64_t)key << 32 | (uint64_t)i);
    if (kept.size() == cap) {
      std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end());
      kept.resize(k);
      bound = (uint32_t)(*std::max_element(kept.begin(), kept.end()) >> 32);
    }
  };
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i top = _mm512_set1_epi32((int)0x80000000u), magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __m512i b = _mm512_castps_si512(v);
    b = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(b, magnitude), b);  // -0 as +0
    const __m512i ascending = _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32(b, 31), top));
    const __m512i key = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q),  // NaN: key 0
                                               _mm512_xor_si512(ascending, _mm512_set1_epi32(-1)));
    const __mmask16 pass = _mm512_cmplt_epu32_mask(key, _mm512_set1_epi32((int)bound));
    if (!pass) continue;
    alignas(64) uint32_t keys[16];
    _mm512_store_si512(keys, key);
    for (int l = 0; l < 16; ++l)  // the bound may fall within the 16
      if ((pass >> l) & 1 && keys[l] < bound) keep(keys[l], i + l);
  }
#endif
  for (; i < V; ++i) {
    const uint32_t key = descending_key(x[i]);
    if (key < bound) keep(key, i);
  }
  const size_t n = std::min(kept.size(), (size_t)k);
  std::partial_sort(kept.begin(), kept.begin() + n, kept.end());
  for (size_t j = 0; j < n; ++j) {
    ids[j] = (int64_t)(uint32_t)kept[j];
    values[j] = x[ids[j]];
  }
}

std::vector<torch::Tensor> ordered_prefix(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && k >= 1 && k <= x.size(1) &&
                  x.size(1) < ((int64_t)1 << 31),
              "ordered_prefix: float32 [N, V] with 1 <= k <= V < 2^31");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto values = torch::empty({N, k}, x.options());
  auto ids = torch::empty({N, k}, x.options().dtype(torch::kLong));
  auto usable = torch::empty({N}, x.options().dtype(torch::kLong));
  auto complete = torch::empty({N}, x.options().dtype(torch::kBool));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t *ip = ids.data_ptr<int64_t>(), *up = usable.data_ptr<int64_t>();
  bool* cp = complete.data_ptr<bool>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> kept;
    kept.reserve(4 * (size_t)k);
    for (int64_t n = begin; n < end; ++n) {
      float* v = vp + n * k;
      top_row(xp + n * V, V, k, v, ip + n * k, kept);
      const float kth = v[k - 1];
      cp[n] = (std::isinf(kth) && kth < 0) || k == V;
      int64_t above = 0;
      for (int64_t j = 0; j < k; ++j) above += v[j] > kth;
      up[n] = cp[n] ? k : above;
    }
  });
  return {values, ids, usable, complete};
}
