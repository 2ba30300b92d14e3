// Dense float32 linear layers in which every output is one chain of fused multiply-adds in k order:
//   acc = 0; for k = 0..K-1: acc = fma(x[m][k], w[n][k], acc); out[m][n] = acc (+ bias[n])
// One IEEE fma per step whatever the tile, the thread or the instruction set runs it, so an output's bits depend on
// its own row and weights alone: batch invariance by construction, without the fixed-height GEMM tiles a library
// needs (ops/batch_invariant.py), and the same bits in every ISA build (tests/ops compares them).
//
// Packed weight: [P][K][16] float32, P = N / 16 rounded up (zero rows past N): panel p holds output rows
// 16p..16p+15, and its k-th 16 floats are w[16p + j][k], j = 0..15 (a 512-bit load per k).
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kRows = 8;  // rows of a tile: 8 rows x 2 panels = 16 accumulators, 2 weight vectors, a broadcast
constexpr int kPanels = 2;

// rows [0, MR) of x against panels [0, NP) starting at w; cols: outputs of this tile that exist (<= 16 * NP)
template <int MR, int NP>
void tile(const float* x, int64_t K, const float* w, int64_t pstride, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 v[NP];
    for (int p = 0; p < NP; ++p) v[p] = _mm512_loadu_ps(w + p * pstride + 16 * k);
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * K + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(b, v[p], acc[r][p]);
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t n = std::min<int64_t>(16, cols - 16 * p);
    if (n <= 0) break;
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * p) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 o = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
      _mm512_mask_storeu_ps(out + r * ldo + 16 * p, mask, o);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 6;  // rows of a tile: 6 rows x 2 halves of a panel = 12 accumulators, 2 weight vectors, a
constexpr int kPanels = 1;  // broadcast (the compiler left the portable loop's std::fma scalar: ~1 FMA a cycle)

template <int MR, int NP>
void tile(const float* x, int64_t K, const float* w, int64_t pstride, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  static_assert(NP == 1, "AVX2 tiles are one panel wide");
  (void)pstride;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 v0 = _mm256_loadu_ps(w + 16 * k), v1 = _mm256_loadu_ps(w + 16 * k + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(b, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, v1, acc[r][1]);
    }
  }
  const int64_t n = std::min<int64_t>(16, cols);
  for (int r = 0; r < MR; ++r) {
    alignas(32) float row[16];
    _mm256_store_ps(row, acc[r][0]);
    _mm256_store_ps(row + 8, acc[r][1]);
    for (int64_t j = 0; j < n; ++j) out[r * ldo + j] = bias ? row[j] + bias[j] : row[j];
  }
}
#else
constexpr int kRows = 4;  // portable: one panel (16 lanes) of 4 rows, vectorized by the compiler where it can
constexpr int kPanels = 1;

template <int MR, int NP>
void tile(const float* x, int64_t K, const float* w, int64_t pstride, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  static_assert(NP == 1, "portable tiles are one panel wide");
  (void)pstride;
  float acc[MR][16] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r) {
      const float b = x[r * K + k];
      for (int j = 0; j < 16; ++j) acc[r][j] = std::fma(b, w[16 * k + j], acc[r][j]);
    }
  const int64_t n = std::min<int64_t>(16, cols);
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < n; ++j) out[r * ldo + j] = bias ? acc[r][j] + bias[j] : acc[r][j];
}
#endif

// the last rows (fewer than kRows): the same chain per output, MR rows at once
template <int MR, int NP>
void tail(const float* x, int64_t rows, int64_t K, const float* w, int64_t pstride, const float* bias, float* out,
          int64_t ldo, int64_t cols) {
  if (rows == MR) return tile<MR, NP>(x, K, w, pstride, bias, out, ldo, cols);
  if constexpr (MR > 1) tail<MR - 1, NP>(x, rows, K, w, pstride, bias, out, ldo, cols);
}

// rows [0, M) against one item of NP panels (the last item may hold fewer than kPanels)
template <int NP>
void item_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t pstride, const float* bias, float* out,
               int64_t ldo, int64_t cols) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, NP>(x + m * K, K, w, pstride, bias, out + m * ldo, ldo, cols);
  if (m < M) tail<kRows - 1, NP>(x + m * K, M - m, K, w, pstride, bias, out + m * ldo, ldo, cols);
}

}  // namespace

// x [M, K] float32, packed [P, K, 16] (see above) -> [M, n] float32 (+ bias [n]).
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "dense_linear: x must be float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == torch::kFloat &&
                  packed.is_contiguous(), "dense_linear: packed must be contiguous float32 [P, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "dense_linear: x has K=", K, ", the packed weight ", packed.size(1));
  TORCH_CHECK(n > 0 && n <= 16 * P && n > 16 * (P - 1), "dense_linear: n=", n, " does not fit ", P, " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  torch::Tensor b;
  if (has_bias) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat && b.numel() == n, "dense_linear: bias must be float32 [n]");
  }
  x = x.contiguous();
  auto out = torch::empty({M, n}, torch::kFloat);
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t pstride = K * 16, items = (P + kPanels - 1) / kPanels;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p0 = i * kPanels, col = 16 * p0, cols = std::min<int64_t>(16 * kPanels, n - col);
      const float* w = wp + p0 * pstride;
      const float* bi = bp ? bp + col : nullptr;
      if (P - p0 >= kPanels) item_rows<kPanels>(xp, M, K, w, pstride, bi, op + col, n, cols);
      else item_rows<1>(xp, M, K, w, pstride, bi, op + col, n, cols);
    }
  });
  return out;
}
