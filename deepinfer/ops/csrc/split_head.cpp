// An LM head's 8-bit symmetric weight (GGUF Q8_0, deepinfer's int8: w = d * (u - 128)) stored as two planes, so
// that a greedy step with few rows reads 5/8 of it. Per group record of 16 rows x 32 values (quant_linear.cpp's
// 8-bit layout, u = 8 * h + l):
//   high [nb][ng][320]: h = u >> 3 (0..31) as quant_linear.cpp's 5-bit records;
//   low  [nb][ng][192]: l = u & 7 as three bit planes per 64-byte register r of the 8-bit record: bytes 24r + 8t..
//                       hold bit t of l for byte i of the register in bit i (little-endian).
// Widening a block's planes back gives the 8-bit records byte for byte, and the 8-bit tiles on them give the bits
// quant_linear gives on the 8-bit layout: the logits and the embedding rows are unchanged.
//
// The greedy token (split_head_argmax) in two passes, exact:
//   1. every output from the high plane alone, as the 5-bit tiles compute w~ = d * (8h + 3.5) (the middle of the
//      values l leaves open): with scale d, c = -15.5625 and the activation scales times 8 (exact);
//   2. the exact outputs (the 8-bit tiles' arithmetic) only of blocks that can hold the largest one.
// |z - z~| <= R_i ||x||_2 by Cauchy-Schwarz, R_i = ||d (l - 3.5)||_2 over row i's weights, plus the float rounding
// of both passes, bounded by E2_i ||x||_1 (E2_i = gamma * 760 * max_g d: every term of either sum is at most 383 d
// |x| and gamma covers 2 ng + 16 roundings, twice; the exact pass, its c = -128 folded into the integer sums, has
// terms of at most 128 d |x| and ng fewer roundings). Row i's bound is bound[i] = (R_i, E2_i), rounded up at packing.
// A row whose upper bound z~ + B falls below the best lower bound z~ - B of any row cannot hold the maximum, nor tie
// it; every other block is computed exactly and scanned in index order. Rows with a non-finite value go the exact
// way entirely (argmax_blocks.h), as do batches of more than max_rows rows, where pass 2 would cost what it saves.
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>

#include "bit_bytes_avx2.h"
#endif

#include "argmax_blocks.h"
#include "ops.h"

namespace {

typedef int32_t __attribute__((may_alias)) bytes4;  // 4 int8 activations read as one operand
constexpr int64_t kHigh = 320, kLow = 192, kWide = 512;  // bytes per group: high record, low planes, 8-bit record
constexpr int64_t kSlack = 4096;  // room past a widened block for the 8-bit tiles' prefetches
// The planes stream from memory: their lines are asked for kAhead groups ahead (4, 8 and 16 measured alike).
#ifndef DI_SPLIT_AHEAD
#define DI_SPLIT_AHEAD 4
#endif
constexpr int64_t kAhead = DI_SPLIT_AHEAD;

struct SplitView {
  const uint8_t* high;
  const uint8_t* low;
  const uint16_t* scales;  // float16 bits [nb][ng][16]
  int64_t nb, ng, k;
};

SplitView split_view(const torch::Tensor& high, const torch::Tensor& low, const torch::Tensor& scales, int64_t k) {
  TORCH_CHECK(k > 0 && k % 32 == 0, "split head: K must be a positive multiple of 32, got ", k);
  const int64_t nb = high.size(0), ng = k / 32;
  TORCH_CHECK(high.scalar_type() == torch::kByte && high.is_contiguous() && high.numel() == nb * ng * kHigh,
              "split head: high plane must be uint8 [nb, K/32, 320]");
  TORCH_CHECK(low.scalar_type() == torch::kByte && low.is_contiguous() && low.numel() == nb * ng * kLow,
              "split head: low planes must be uint8 [nb, K/32, 192]");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.numel() == nb * ng * 16,
              "split head: scales must be float16 [nb, K/32, 16]");
  return SplitView{high.data_ptr<uint8_t>(), low.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), nb, ng, k};
}

#include "split_planes.h"  // prefetch_planes, Unpack, quant_at, widen

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Block b's outputs for one activation row, exactly as the 8-bit tiles compute them on the widened records (the
// same integer sums, started at -128 * sum(xq) of the group, then per group acc += float(isum) * (scale * d)), the
// unpacking done in registers: one row reads the planes once and widens nothing to memory. xs: the row's sums of
// xq per 16 values.
void exact_row(const SplitView& w, int64_t b, const int8_t* xq, const float* xd, const int32_t* xs, float* out) {
  const Unpack un;
  const uint8_t* h = w.high + b * w.ng * kHigh;
  const uint8_t* l = w.low + b * w.ng * kLow;
  const uint16_t* s = w.scales + b * w.ng * 16;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.ng; ++g, h += kHigh, l += kLow) {
    prefetch_planes(h, l);
    __m512i isum = _mm512_set1_epi32(-128 * (xs[2 * g] + xs[2 * g + 1]));
    for (int p = 0; p < 4; ++p)
      un.piece(h, l, p, [&](int r, __m512i u) {  // the 4 activations broadcast from memory, as the tiles do
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(isum) : "v"(u), "m"(*reinterpret_cast<const bytes4*>(xq + 32 * g + 4 * r)));
      });
    const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * g)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sv, _mm512_set1_ps(xd[g])), acc);
  }
  _mm512_storeu_ps(out, acc);
}
#endif

// The exact outputs of blocks b..e-1 for M rows of activations (a row at a time: xq + m * K etc.): out[m * ldo +
// 16 * (b' - b) + j]. Up to kRowsInRegisters rows unpack the planes in registers for each row (exact_row); more
// widen each block to memory once for the 8-bit tiles of all rows. scratch: kWide * ng + kSlack bytes.
#ifndef DI_SPLIT_REGISTER_ROWS
#define DI_SPLIT_REGISTER_ROWS 2
#endif
constexpr int64_t kRowsInRegisters = DI_SPLIT_REGISTER_ROWS;
void exact_blocks(const SplitView& w, const int8_t* xq, const float* xd, const int32_t* xs, const float* xt,
                  int64_t M, float* out, int64_t ldo, int64_t b, int64_t e, uint8_t* scratch) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)  // AVX-512 without VNNI: widened
  if (M <= kRowsInRegisters) {
    const int64_t K = w.k;
    for (int64_t bb = b; bb < e; ++bb)
      for (int64_t m = 0; m < M; ++m)
        exact_row(w, bb, xq + m * K, xd + m * (K / 32), xs + m * (K / 16), out + m * ldo + 16 * (bb - b));
    return;
  }
#endif
  for (int64_t bb = b; bb < e; ++bb) {
    widen(w, bb, scratch);
    const QuantView v{scratch, w.scales + bb * w.ng * 16, nullptr, -128.f, 8, 32, 1, w.k, true, false};
    quant_blocks(v, xq, xd, xs, xt, M, out + 16 * (bb - b), ldo, 0, 1, 0);
  }
}

std::vector<uint8_t> scratch_for(const SplitView& w) { return std::vector<uint8_t>(w.ng * kWide + kSlack); }

torch::Tensor exact_argmax(const SplitView& w, const QuantActs& a, int64_t M, int64_t n) {
  return argmax_over_blocks(M, w.nb, n, [&](float* buf, int64_t ldo, int64_t b, int64_t e) {
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(w.ng * kWide + kSlack);
    exact_blocks(w, a.xq.data_ptr<int8_t>(), a.xd.data_ptr<float>(), a.xs.data_ptr<int32_t>(),
                 a.xt.data_ptr<float>(), M, buf, ldo, b, e, scratch.data());
  });
}

// A block's largest lower and upper bounds z~ -+ B over its first `cols` outputs, B = R l2 + E2 l1 (r: the 16 rows'
// (R, E2) pairs); false where a value or a bound is not finite.
inline bool block_bounds(const float* z, const float* r, int cols, float l2, float l1, float* lo, float* hi) {
#if defined(__AVX512F__)
  const __mmask16 k = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512 a = _mm512_loadu_ps(r), b = _mm512_loadu_ps(r + 16);
  const __m512 B = _mm512_add_ps(_mm512_mul_ps(_mm512_permutex2var_ps(a, even, b), _mm512_set1_ps(l2)),
                                 _mm512_mul_ps(_mm512_permutex2var_ps(a, odd, b), _mm512_set1_ps(l1)));
  const __m512 v = _mm512_maskz_loadu_ps(k, z), zero = _mm512_setzero_ps();
  // x - x is 0 for every finite x, NaN for inf and NaN
  const __mmask16 ok = _mm512_mask_cmp_ps_mask(k, _mm512_sub_ps(v, v), zero, _CMP_EQ_OQ) &
                       _mm512_mask_cmp_ps_mask(k, _mm512_sub_ps(B, B), zero, _CMP_EQ_OQ);
  *lo = _mm512_mask_reduce_max_ps(k, _mm512_sub_ps(v, B));
  *hi = _mm512_mask_reduce_max_ps(k, _mm512_add_ps(v, B));
  return ok == k;
#else
  float low = -INFINITY, high = -INFINITY;
  bool finite = true;
  for (int j = 0; j < cols; ++j) {
    const float B = r[2 * j] * l2 + r[2 * j + 1] * l1;
    finite = finite && std::isfinite(z[j]) && std::isfinite(B);
    low = std::max(low, z[j] - B);
    high = std::max(high, z[j] + B);
  }
  *lo = low, *hi = high;
  return finite;
#endif
}

struct Candidate {
  int64_t m, b;
  float ub;  // the block's largest upper bound
};

}  // namespace

torch::Tensor split_head_linear(torch::Tensor x, torch::Tensor high, torch::Tensor low, torch::Tensor scales,
                                int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "split_head_linear: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  const SplitView w = split_view(high, low, scales, x.size(1));
  TORCH_CHECK(n > 0 && n <= w.nb * 16, "split_head_linear: n=", n, " outside the weight's ", w.nb * 16, " rows");
  auto out = torch::empty({M, w.nb * 16}, torch::kFloat);
  if (M > 0) {
    const QuantActs a = quantize_acts(x);
    at::parallel_for(0, w.nb, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> scratch = scratch_for(w);
      exact_blocks(w, a.xq.data_ptr<int8_t>(), a.xd.data_ptr<float>(), a.xs.data_ptr<int32_t>(),
                   a.xt.data_ptr<float>(), M, out.data_ptr<float>() + 16 * begin, w.nb * 16, begin, end,
                   scratch.data());
    });
  }
  return w.nb * 16 == n ? out : out.narrow(1, 0, n).contiguous();
}

torch::Tensor split_head_rows(torch::Tensor ids, torch::Tensor high, torch::Tensor low, torch::Tensor scales,
                              int64_t k) {
  ids = ids.contiguous().to(torch::kLong);
  const SplitView w = split_view(high, low, scales, k);
  const int64_t T = ids.numel();
  const auto* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < w.nb * 16, "split_head_rows: id ", id[t], " out of range");
  auto out = torch::empty({T, k}, torch::kFloat);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = id[t] / 16;
      const int j = (int)(id[t] % 16);
      float* dst = out.data_ptr<float>() + t * k;
      for (int64_t g = 0; g < w.ng; ++g) {  // value i of row j: register i / 4, byte 4j + i % 4 (quant_linear.cpp)
        const uint8_t* h = w.high + (b * w.ng + g) * kHigh;
        const uint8_t* l = w.low + (b * w.ng + g) * kLow;
        const float s = c10::detail::fp16_ieee_to_fp32_value(w.scales[(b * w.ng + g) * 16 + j]);
        for (int i = 0; i < 32; ++i) dst[32 * g + i] = s * (float)((int)quant_at(h, l, i / 4, 4 * j + i % 4) - 128);
      }
    }
  });
  return out;
}

torch::Tensor split_head_argmax(torch::Tensor x, torch::Tensor high, torch::Tensor low, torch::Tensor scales,
                                torch::Tensor bound, int64_t n, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "split_head_argmax: x must be float32 [M, K]");
  TORCH_CHECK(n > 0 && n < ((int64_t)1 << 31), "split_head_argmax: 0 < n < 2^31 outputs, got ", n);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const SplitView w = split_view(high, low, scales, K);
  TORCH_CHECK(n <= w.nb * 16, "split_head_argmax: n=", n, " exceeds the weight's ", w.nb * 16, " rows");
  TORCH_CHECK(bound.scalar_type() == torch::kFloat && bound.is_contiguous() && bound.numel() == w.nb * 32,
              "split_head_argmax: bound must be float32 [nb * 16, 2]");
  if (M == 0) return torch::empty({0}, torch::TensorOptions().dtype(torch::kLong));
  const QuantActs a = quantize_acts(x);
  if (M > max_rows) return exact_argmax(w, a, M, n);
  // per row: ||x||_2 and ||x||_1 of the rounded activations, rounded up
  std::vector<float> l2(M), l1(M);
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const float* xd = a.xd.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i)  // the rounding maps NaN and inf to values the norms below do not see
    if (!std::isfinite(xp[i])) return exact_argmax(w, a, M, n);
  for (int64_t m = 0; m < M; ++m) {
    double s2 = 0, s1 = 0;
    for (int64_t g = 0; g < K / 32; ++g) {
      int64_t q2 = 0, q1 = 0;
      for (int i = 0; i < 32; ++i) q2 += xq[m * K + 32 * g + i] * xq[m * K + 32 * g + i], q1 += std::abs(xq[m * K + 32 * g + i]);
      s2 += (double)xd[m * K / 32 + g] * xd[m * K / 32 + g] * q2;
      s1 += (double)xd[m * K / 32 + g] * q1;
    }
    l2[m] = (float)(std::sqrt(s2) * (1 + 1e-6));
    l1[m] = (float)(s1 * (1 + 1e-6));
    if (!std::isfinite(l2[m]) || !std::isfinite(l1[m])) return exact_argmax(w, a, M, n);
  }
  // pass 1: z~ from the high plane, with each thread's running best lower bound per row
  const torch::Tensor xd8 = a.xd.mul(8), xt8 = a.xt.mul(8);  // exact: a power of two
  const QuantView v5{w.high, w.scales, nullptr, -15.5625f, 5, 32, w.nb, K, true, false};
  const float* bd = bound.data_ptr<float>();
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), w.nb));
  const int64_t pass = std::clamp<int64_t>(4096 / M, 1, 64);
  std::vector<float> lower(T * M, -INFINITY);
  std::vector<std::vector<Candidate>> found(T);
  std::vector<char> bad(T, 0);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(M * 16 * pass);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * w.nb / T, b1 = (t + 1) * w.nb / T;
      for (int64_t b = b0; b < b1 && 16 * b < n; b += pass) {
        const int64_t e = std::min(b + pass, b1), width = 16 * (e - b);
        quant_blocks(v5, xq, xd8.data_ptr<float>(), a.xs.data_ptr<int32_t>(), xt8.data_ptr<float>(), M, buf.data(),
                     width, b, e, b);
        for (int64_t m = 0; m < M; ++m) {
          float& low_m = lower[t * M + m];
          for (int64_t bb = b; bb < e; ++bb) {
            const float* z = buf.data() + m * width + 16 * (bb - b);
            const float* r = bd + 32 * bb;
            const int cols = (int)std::min<int64_t>(16, n - 16 * bb);
            float lo, hi;
            if (!block_bounds(z, r, cols, l2[m], l1[m], &lo, &hi)) bad[t] = 1;
            low_m = std::max(low_m, lo);
            if (hi >= low_m) found[t].push_back({m, bb, hi});
          }
        }
      }
    }
  });
  if (std::any_of(bad.begin(), bad.end(), [](char c) { return c != 0; })) return exact_argmax(w, a, M, n);
  std::vector<Candidate> cands = surviving(found, lower, T, M);
  std::sort(cands.begin(), cands.end(), [](const Candidate& p, const Candidate& q) {
    return p.m != q.m ? p.m < q.m : p.b < q.b;
  });
  // pass 2: the candidate blocks exactly, each block's first largest value
  const int64_t C = (int64_t)cands.size();
  std::vector<float> value(C);
  std::vector<int64_t> index(C);
  at::parallel_for(0, C, 8, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch = scratch_for(w);
    float out[16];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = cands[i].m, b = cands[i].b;
      exact_blocks(w, xq + m * K, xd + m * (K / 32), a.xs.data_ptr<int32_t>() + m * (K / 16),
                   a.xt.data_ptr<float>() + m * (3 * K / 32), 1, out, 16, b, b + 1, scratch.data());
      ArgmaxScan scan;
      scan.feed(out, std::min<int64_t>(16, n - 16 * b), 16 * b);
      index[i] = scan.finish(&value[i]);
    }
  });
  auto result = torch::empty({M}, torch::TensorOptions().dtype(torch::kLong));
  int64_t* op = result.data_ptr<int64_t>();
  std::fill(op, op + M, -1);
  std::vector<float> top(M, -INFINITY);
  for (int64_t i = 0; i < C; ++i) {  // blocks in index order per row: a later block wins only by a larger value
    const int64_t m = cands[i].m;
    if (std::isnan(value[i])) return exact_argmax(w, a, M, n);
    if (op[m] < 0 || value[i] > top[m]) top[m] = value[i], op[m] = index[i];
  }
  for (int64_t m = 0; m < M; ++m)
    if (op[m] < 0) return exact_argmax(w, a, M, n);  // no candidate: only where bounds were not finite
  return result;
}
