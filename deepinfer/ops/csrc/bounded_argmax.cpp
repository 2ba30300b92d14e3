// The greedy tokens of many rows from an 8-bit symmetric LM head (GGUF Q8_0, deepinfer's int8: w = d (u - 128) in
// quant_linear.cpp's 8-bit records, float16 scales), exactly quant_linear_argmax's, in two passes, for CPUs whose
// 8-bit products cost more than 6-bit ones (AVX2 without VNNI: a full byte needs `sign`, `maddubs` and a `madd` per
// 32 products and row; quants below 64 multiply unsigned, and two pieces' products add in int16 before one `madd`).
//   1. every output from the top 6 bits of its quants alone, h = u >> 2, as if the low 2 bits l = u & 3 were 1.5
//      (the middle of the values they leave open): z~ = sum_g d xd (4 S_h - 126.5 S_x) = sum_g float(8 S_h - 253 S_x)
//      * (d / 2 * xd), the integer exact (S_h = sum h xq, S_x = sum xq over the group);
//   2. the exact outputs (quant_blocks, the very code quant_linear_argmax runs) only of the blocks that can hold a
//      row's largest one, each block once for all the rows that need it.
// |z - z~| <= R_i ||x||_2 by Cauchy-Schwarz, R_i = ||d (l - 1.5)||_2 over output i's weights (x: the rounded
// activations xd * xq), plus the float rounding of both passes, at most (2 ng + 2) 2^-24 (128 + 126.5) max_g |d|
// ||x||_1 to first order; E_i = (2 ng + 16) 2^-23 * 512 * max_g |d| covers it and the rounding of the bounds
// themselves several times over; kSlack (2^-110) covers the absolute rounding of products that fall below float's
// normal range (activations near 1e-38: each such term may lose all its bits, at most ~1e-37 in all). bound
// [nb][2][16] holds R and E per block, rounded up (quant_argmax_bound). A block
// whose every upper bound z~ + B falls below a row's best lower bound z~ - B of any output cannot hold that row's
// largest value nor tie it; the other blocks are computed exactly and scanned in index order, so the index is the
// first of the largest values, as torch.argmax of quant_linear's outputs gives. Rows with a value that is not
// finite, and any bound that is not, go the exact way (quant_linear_argmax).
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
#define DI_BOUND_AVX2 1
#include <immintrin.h>
#endif

#include "argmax_blocks.h"  // surviving (and argmax_scan.h)
#include "ops.h"

namespace {

constexpr int64_t kRecord = 512;  // bytes of one group record: 16 outputs x 32 values
constexpr float kSlack = 0x1p-110f;  // added to every bound (the header)

inline float half_value(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// Pass 1 for MT rows (xq + m * K ...) and one block (q: its records, s: its scales) -> out[m * 16 + j].
#if defined(DI_BOUND_AVX2)
template <int MT>
void approx_block(const uint8_t* q, const uint16_t* s, int64_t ng, const int8_t* xq, const float* xd,
                  const int32_t* xs, int64_t K, float* out) {
  const __m256i top6 = _mm256_set1_epi8(0x3F), one = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* rec = q + g * kRecord;
    for (int line = 0; line < kRecord; line += 64)  // the block after next's group g
      _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * ng * kRecord + line), _MM_HINT_T0);
    __m256i isum[MT][2];
    for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int p0 = 0; p0 < 8; p0 += 2) {  // pieces of 4 values; a pair of products <= 2 * 63 * 127, two pieces' < 2^15
      __m256i s16[MT][2];
      for (int m = 0; m < MT; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
      for (int p = p0; p < p0 + 2; ++p) {
        const __m256i w0 = _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p)), 2), top6);
        const __m256i w1 = _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p + 32)), 2), top6);
        for (int m = 0; m < MT; ++m) {
          int32_t four;
          std::memcpy(&four, xq + m * K + 32 * g + 4 * p, 4);
          const __m256i x = _mm256_set1_epi32(four);
          s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(w0, x));
          s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(w1, x));
        }
      }
      for (int m = 0; m < MT; ++m)
        for (int h = 0; h < 2; ++h) isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_madd_epi16(s16[m][h], one));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 half_d = _mm256_mul_ps(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * g + 8 * h))), _mm256_set1_ps(0.5f));
      for (int m = 0; m < MT; ++m) {
        const int32_t sx = xs[m * (K / 16) + 2 * g] + xs[m * (K / 16) + 2 * g + 1];
        const __m256i i2 = _mm256_sub_epi32(_mm256_slli_epi32(isum[m][h], 3), _mm256_set1_epi32(253 * sx));
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i2), _mm256_mul_ps(half_d, _mm256_set1_ps(xd[m * (K / 32) + g])),
                                    acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + 16 * m + 8 * h, acc[m][h]);
}
#else
template <int MT>
void approx_block(const uint8_t* q, const uint16_t* s, int64_t ng, const int8_t* xq, const float* xd,
                  const int32_t* xs, int64_t K, float* out) {
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 16; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        int32_t sh = 0;
        for (int i = 0; i < 32; ++i)  // value i: piece i / 4, byte 4j + i % 4
          sh += (q[g * kRecord + 64 * (i / 4) + 4 * j + i % 4] >> 2) * xq[m * K + 32 * g + i];
        const int32_t sx = xs[m * (K / 16) + 2 * g] + xs[m * (K / 16) + 2 * g + 1];
        acc += (float)(8 * sh - 253 * sx) * (half_value(s[16 * g + j]) * 0.5f * xd[m * (K / 32) + g]);
      }
      out[16 * m + j] = acc;
    }
}
#endif

// A block's largest lower and upper bounds z~ -+ B over its first `cols` outputs, B = R l2 + E l1; false where a
// value or a bound is not finite.
#if defined(DI_BOUND_AVX2)
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
#endif

inline bool block_bounds(const float* z, const float* bound, int cols, float l2, float l1, float* lo, float* hi) {
#if defined(DI_BOUND_AVX2)
  if (cols == 16) {  // the same products and sums as the loop below, 8 outputs at a time
    const __m256 L2 = _mm256_set1_ps(l2), L1 = _mm256_set1_ps(l1), zero = _mm256_setzero_ps();
    __m256 low = _mm256_set1_ps(-INFINITY), high = low, off = zero;
    for (int h = 0; h < 2; ++h) {
      const __m256 B = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(bound + 8 * h), L2),
                                                   _mm256_mul_ps(_mm256_loadu_ps(bound + 16 + 8 * h), L1)),
                                     _mm256_set1_ps(kSlack));
      const __m256 v = _mm256_loadu_ps(z + 8 * h);
      // x - x is 0 for every finite x, NaN for inf and NaN
      off = _mm256_or_ps(off, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_NEQ_UQ));
      off = _mm256_or_ps(off, _mm256_cmp_ps(_mm256_sub_ps(B, B), zero, _CMP_NEQ_UQ));
      low = _mm256_max_ps(low, _mm256_sub_ps(v, B));
      high = _mm256_max_ps(high, _mm256_add_ps(v, B));
    }
    *lo = max8(low), *hi = max8(high);
    return _mm256_movemask_ps(off) == 0;
  }
#endif
  float low = -INFINITY, high = -INFINITY;
  bool finite = true;
  for (int j = 0; j < cols; ++j) {
    const float B = bound[j] * l2 + bound[16 + j] * l1 + kSlack;
    finite = finite && std::isfinite(z[j]) && std::isfinite(B);
    low = std::max(low, z[j] - B);
    high = std::max(high, z[j] + B);
  }
  *lo = low, *hi = high;
  return finite;
}

struct Candidate {
  int64_t b, m;
  float ub;
};

void check_head(const torch::Tensor& quants, const torch::Tensor& scales, const torch::Tensor& offsets, int64_t bits,
                int64_t group, double c, int64_t k, const char* op) {
  TORCH_CHECK(bits == 8 && group == 32 && c == -128 && offsets.numel() == 0, op,
              ": an 8-bit symmetric weight in groups of 32 (Q8_0, int8: c = -128) only");
  TORCH_CHECK(k > 0 && k % 32 == 0, op, ": K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(quants.scalar_type() == torch::kByte && quants.is_contiguous() && quants.dim() == 3 &&
                  quants.size(1) == k / 32 && quants.size(2) == kRecord,
              op, ": quants must be uint8 [nb, K/32, 512]");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.numel() == quants.size(0) * (k / 32) * 16,
              op, ": scales must be float16 [nb, K/32, 16]");
}

}  // namespace

torch::Tensor quant_argmax_bound(torch::Tensor quants, torch::Tensor scales, int64_t k) {
  check_head(quants, scales, torch::empty({0}), 8, 32, -128, k, "quant_argmax_bound");
  const int64_t nb = quants.size(0), ng = k / 32;
  auto out = torch::empty({nb, 2, 16}, torch::kFloat);
  const uint8_t* q = quants.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  const double gamma = (2.0 * ng + 16) * std::ldexp(1.0, -23);
  at::parallel_for(0, nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int j = 0; j < 16; ++j) {
        double r2 = 0, dmax = 0;
        for (int64_t g = 0; g < ng; ++g) {
          const double d = std::fabs((double)half_value(s[(b * ng + g) * 16 + j]));
          double c2 = 0;
          for (int i = 0; i < 32; ++i) {
            const double l = (q[(b * ng + g) * kRecord + 64 * (i / 4) + 4 * j + i % 4] & 3) - 1.5;
            c2 += l * l;
          }
          r2 += d * d * c2;
          dmax = std::max(dmax, d);
        }
        const float R = (float)(std::sqrt(r2) * (1 + std::ldexp(1.0, -20)));
        const float E = (float)(gamma * 512 * dmax * (1 + std::ldexp(1.0, -20)));
        o[b * 32 + j] = std::nextafter(R, INFINITY);
        o[b * 32 + 16 + j] = std::nextafter(E, INFINITY);
      }
  });
  return out;
}

torch::Tensor quant_argmax_bounded(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                                   int64_t bits, int64_t group, double c, int64_t n, torch::Tensor bound) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quant_argmax_bounded: x must be float32 [M, K]");
  TORCH_CHECK(n > 0 && n < ((int64_t)1 << 31), "quant_argmax_bounded: 0 < n < 2^31 outputs, got ", n);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), ng = K / 32;
  check_head(quants, scales, offsets, bits, group, c, K, "quant_argmax_bounded");
  const int64_t nb = quants.size(0);
  TORCH_CHECK(n <= nb * 16, "quant_argmax_bounded: n=", n, " exceeds the weight's ", nb * 16, " rows");
  TORCH_CHECK(bound.scalar_type() == torch::kFloat && bound.is_contiguous() && bound.numel() == nb * 32,
              "quant_argmax_bounded: bound must be float32 [nb, 2, 16] (quant_argmax_bound)");
  auto exact = [&] { return quant_linear_argmax(x, quants, scales, offsets, bits, group, c, n); };
  if (M == 0) return torch::empty({0}, torch::TensorOptions().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i)  // the rounding maps NaN and inf to values the norms below do not see
    if (!std::isfinite(xp[i])) return exact();
  const QuantActs a = quantize_acts(x);
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const float* xd = a.xd.data_ptr<float>();
  const int32_t* xs = a.xs.data_ptr<int32_t>();
  std::vector<float> l2(M), l1(M);  // ||x||_2 and ||x||_1 of the rounded activations, rounded up
  for (int64_t m = 0; m < M; ++m) {
    double s2 = 0, s1 = 0;
    for (int64_t g = 0; g < ng; ++g) {
      int64_t q2 = 0, q1 = 0;
      for (int i = 0; i < 32; ++i) q2 += xq[m * K + 32 * g + i] * xq[m * K + 32 * g + i], q1 += std::abs(xq[m * K + 32 * g + i]);
      s2 += (double)xd[m * ng + g] * xd[m * ng + g] * q2;
      s1 += (double)xd[m * ng + g] * q1;
    }
    l2[m] = (float)(std::sqrt(s2) * (1 + 1e-6));
    l1[m] = (float)(s1 * (1 + 1e-6));
    if (!std::isfinite(l2[m]) || !std::isfinite(l1[m])) return exact();
  }
  // pass 1: each thread a contiguous range of blocks, a block for all rows (3 at a time) while it is in cache
  const uint8_t* q = quants.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const float* bd = bound.data_ptr<float>();
  const int64_t used = (n + 15) / 16;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), used));
  std::vector<float> lower(T * M, -INFINITY);
  std::vector<std::vector<Candidate>> found(T);
  std::vector<char> bad(T, 0);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> z(M * 16);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = t * used / T; b < (t + 1) * used / T; ++b) {
        const uint8_t* qb = q + b * ng * kRecord;
        const uint16_t* sb = s + b * ng * 16;
        int64_t m = 0;
        for (; m + 3 <= M; m += 3) approx_block<3>(qb, sb, ng, xq + m * K, xd + m * ng, xs + m * 2 * ng, K, &z[16 * m]);
        if (M - m == 2) approx_block<2>(qb, sb, ng, xq + m * K, xd + m * ng, xs + m * 2 * ng, K, &z[16 * m]);
        if (M - m == 1) approx_block<1>(qb, sb, ng, xq + m * K, xd + m * ng, xs + m * 2 * ng, K, &z[16 * m]);
        const int cols = (int)std::min<int64_t>(16, n - 16 * b);
        for (m = 0; m < M; ++m) {
          float lo, hi;
          if (!block_bounds(&z[16 * m], bd + 32 * b, cols, l2[m], l1[m], &lo, &hi)) bad[t] = 1;
          float& low_m = lower[t * M + m];
          low_m = std::max(low_m, lo);
          if (hi >= low_m) found[t].push_back({b, m, hi});
        }
      }
    }
  });
  if (std::any_of(bad.begin(), bad.end(), [](char v) { return v != 0; })) return exact();
  std::vector<Candidate> cands = surviving(found, lower, T, M);
  std::sort(cands.begin(), cands.end(), [](const Candidate& p, const Candidate& r) {
    return p.b != r.b ? p.b < r.b : p.m < r.m;
  });
  // pass 2: per candidate block, its rows' activations gathered and the block computed exactly for them at once
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < (int64_t)cands.size(); ++i)
    if (i == 0 || cands[i].b != cands[i - 1].b) starts.push_back(i);
  starts.push_back((int64_t)cands.size());
  std::vector<float> value(cands.size());
  std::vector<int64_t> index(cands.size());
  const QuantView w = quant_view(quants, scales, offsets, bits, group, c, K);
  const float* xt = a.xt.data_ptr<float>();
  at::parallel_for(0, (int64_t)starts.size() - 1, 4, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> gq;
    std::vector<float> gd, gt, out;
    std::vector<int32_t> gs;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t i0 = starts[u], rows = starts[u + 1] - i0, b = cands[i0].b;
      gq.resize(rows * K), gd.resize(rows * ng), gs.resize(rows * 2 * ng), gt.resize(rows * 3 * ng), out.resize(rows * 16);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = cands[i0 + r].m;
        std::memcpy(&gq[r * K], xq + m * K, K);
        std::memcpy(&gd[r * ng], xd + m * ng, ng * sizeof(float));
        std::memcpy(&gs[r * 2 * ng], xs + m * 2 * ng, 2 * ng * sizeof(int32_t));
        std::memcpy(&gt[r * 3 * ng], xt + m * 3 * ng, 3 * ng * sizeof(float));
      }
      quant_blocks(w, gq.data(), gd.data(), gs.data(), gt.data(), rows, out.data(), 16, b, b + 1, b);
      for (int64_t r = 0; r < rows; ++r) {
        ArgmaxScan scan;
        scan.feed(&out[16 * r], std::min<int64_t>(16, n - 16 * b), 16 * b);
        index[i0 + r] = scan.finish(&value[i0 + r]);
      }
    }
  });
  auto result = torch::empty({M}, torch::TensorOptions().dtype(torch::kLong));
  int64_t* op = result.data_ptr<int64_t>();
  std::fill(op, op + M, -1);
  std::vector<float> top(M, -INFINITY);
  for (size_t i = 0; i < cands.size(); ++i) {  // blocks in index order: a later block wins only by a larger value
    const int64_t m = cands[i].m;
    if (std::isnan(value[i])) return exact();
    if (op[m] < 0 || value[i] > top[m]) top[m] = value[i], op[m] = index[i];
  }
  for (int64_t m = 0; m < M; ++m)
    if (op[m] < 0) return exact();  // no candidate: only where the bounds were not finite
  return result;
}
