// The fused argmax loop of an LM head (head_argmax.cpp, split_head.cpp): each thread computes a contiguous range of
// 16-column blocks, a few at a time into a buffer that stays in cache, and scans them as they come (ArgmaxScan);
// the threads' answers are then combined in column order: the first NaN wins, else the largest value, earlier
// columns winning ties. compute(buf, ldo, b, e) writes blocks b..e-1 of the M rows at buf[m * ldo + 16 * (b' - b)].
// Also the step the two-pass heads (split_head.cpp, bounded_argmax.cpp) share between their passes: surviving.
#pragma once
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "argmax_scan.h"

template <class Compute>
torch::Tensor argmax_over_blocks(int64_t M, int64_t nb, int64_t n, const Compute& compute) {
  auto out = torch::empty({M}, torch::TensorOptions().dtype(torch::kLong));
  if (M == 0) return out;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nb));
  const int64_t pass = std::clamp<int64_t>(4096 / M, 1, 64);  // blocks per buffer: at most 256 KB of values
  std::vector<float> values(T * M);
  std::vector<int64_t> firsts(T * M);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(M * 16 * pass);
    std::vector<ArgmaxScan> scans(M);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(scans.begin(), scans.end(), ArgmaxScan());
      const int64_t b0 = t * nb / T, b1 = (t + 1) * nb / T;
      for (int64_t b = b0; b < b1 && 16 * b < n; b += pass) {
        const int64_t e = std::min(b + pass, b1), width = 16 * (e - b);
        compute(buf.data(), width, b, e);
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

// The two-pass heads' candidates (each with its row m and an upper bound ub) that can still hold their row's largest
// value: ub at or above the best lower bound any of the T threads found for the row (lower[t * M + m]).
template <class Candidate>
std::vector<Candidate> surviving(const std::vector<std::vector<Candidate>>& found, const std::vector<float>& lower,
                                 int64_t T, int64_t M) {
  std::vector<float> best_low(M, -INFINITY);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t m = 0; m < M; ++m) best_low[m] = std::max(best_low[m], lower[t * M + m]);
  std::vector<Candidate> kept;
  for (const auto& f : found)
    for (const Candidate& c : f)
      if (c.ub >= best_low[c.m]) kept.push_back(c);
  return kept;
}
