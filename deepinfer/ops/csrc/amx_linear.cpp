// y = x W^T (+ b) for many rows (prompt tokens) on AMX tiles: x rounded to bfloat16, W a quantized weight (its
// packed blocks, quant_linear.cpp) dequantized to bfloat16 tile by tile as the kernel goes (amx_dequant.h: no copy
// of the weight is kept), products summed in float32 by TDPBF16PS, K in order.
//
// Every output is the same 16 x 16 x 32 tile instructions over the same k-chunks in the same order, whatever the
// number of rows and wherever the row sits in the batch: a row's output does not depend on its neighbours (oneDNN's
// bfloat16 matmul splits K by the row count, so its rows change bits with the batch: ops/wide_linear.py).
//
// An item is a pair of column blocks over a block of rows: the pair's weight is dequantized into tiles
// [2][K / 32][16][32] bfloat16 (tile row r: the pairs (k = 2r, 2r + 1) of its 16 columns, the layout TDPBF16PS
// reads its second source in), then multiplied with every row of the block.
#include "aten.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <memory>

#include "amx_dequant.h"

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureXtiledata = 18;     // AMX tile data

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands AMX state to a process only on request; once granted it holds for every thread.
bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Where tile register C goes: straight into y when all 16 x 16 outputs are valid, else into a scratch tile.
// (The tile intrinsics name their register in the instruction text: C must be a literal, hence a macro.)
#define DI_STORE_TILE(C, y, ldy, rows, cols, scratch) \
  _tile_stored(C, (rows) == 16 && (cols) == 16 ? (y) : (scratch), (rows) == 16 && (cols) == 16 ? (ldy) * 4 : 64)

// The valid part of a tile stored in scratch copied to y, then the bias added to its rows.
void finish(float* y, int64_t ldy, int64_t rows, int64_t cols, const float* bias, const float* scratch) {
  if (rows != 16 || cols != 16)
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * ldy, scratch + r * 16, cols * sizeof(float));
  if (bias != nullptr) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 b = _mm512_maskz_loadu_ps(mask, bias);
    for (int64_t r = 0; r < rows; ++r)
      _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y + r * ldy), b));
  }
}

// Up to 32 rows x 32 columns: two A tiles (rows m0, m0 + 16) by two B tiles (n-blocks nb, nb + 1), K in order;
// one group of the next pair's dequantization (side) per k-chunk: SmolLM2's four shapes 1.05x at 128-2048 rows
// against dequantizing each pair before its products (0.9x at 16 rows, where the job outlasts one block's chunks).
template <bool TwoM, bool TwoN>
void block(const uint16_t* a, const uint16_t* b0, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t m0,
           int64_t nb, const float* bias, float* scratch, amx_dequant::PairJob& side) {
  const int64_t kc = K / 32, lda = K * 2;
  const uint16_t* b1 = b0 + kc * 512;
  _tile_zero(0);
  if (TwoN) _tile_zero(1);
  if (TwoM) _tile_zero(2);
  if (TwoM && TwoN) _tile_zero(3);
  for (int64_t c = 0; c < kc; ++c) {
    _tile_loadd(4, a + m0 * K + c * 32, lda);
    _tile_loadd(6, b0 + c * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TwoN) {
      _tile_loadd(7, b1 + c * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (TwoM) {
      _tile_loadd(5, a + (m0 + 16) * K + c * 32, lda);
      _tile_dpbf16ps(2, 5, 6);
      if (TwoN) _tile_dpbf16ps(3, 5, 7);
    }
    side.step();
  }
  const int64_t n0 = nb * 16, rows0 = std::min<int64_t>(16, M - m0), cols0 = std::min<int64_t>(16, N - n0);
  const int64_t cols1 = TwoN ? std::min<int64_t>(16, N - n0 - 16) : 0;
  const int64_t rows1 = TwoM ? std::min<int64_t>(16, M - m0 - 16) : 0;
  const float* bias0 = bias ? bias + n0 : nullptr;
  const float* bias1 = bias ? bias + n0 + 16 : nullptr;
  float* y0 = y + m0 * ldy + n0;
  float* y1 = y0 + 16 * ldy;
  DI_STORE_TILE(0, y0, ldy, rows0, cols0, scratch);
  finish(y0, ldy, rows0, cols0, bias0, scratch);
  if (TwoN) {
    DI_STORE_TILE(1, y0 + 16, ldy, rows0, cols1, scratch);
    finish(y0 + 16, ldy, rows0, cols1, bias1, scratch);
  }
  if (rows1 > 0) {  // rows m0 + 16 .. exist in the padded activations, maybe not in y
    DI_STORE_TILE(2, y1, ldy, rows1, cols0, scratch);
    finish(y1, ldy, rows1, cols0, bias0, scratch);
    if (TwoN) {
      DI_STORE_TILE(3, y1 + 16, ldy, rows1, cols1, scratch);
      finish(y1 + 16, ldy, rows1, cols1, bias1, scratch);
    }
  }
}

}  // namespace

bool amx_ready() { return tiles_granted(); }

void amx_configure() {
  // C: tiles 0-3, A: 4-5, B: 6-7, each 16 rows of 64 bytes. A constant in memory: GCC's _tile_loadconfig tells the
  // compiler it reads 8 bytes, so a configuration built on the stack may lose the stores to the rest of it.
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  _tile_loadconfig(&cfg);
}

void amx_release() { _tile_release(); }

void amx_round_row(const float* x, int64_t K, uint16_t* a) {
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
    _mm512_storeu_si512(a + k, (__m512i)v);
  }
}

// Rows per item: an item is one column pair over a block of rows, so the block's activations stay in L2 while the
// weights pass once per block (column pair by column pair, each dequantized once and reused for all the block's
// rows). 512 rows where their bfloat16 activations take at most 1.5 MiB (K <= 1536), else 256. Measured (2 threads,
// SmolLM2's four shapes at 128-2048 rows): 256 / 512 / 1024 rows 16.9 / 14.7 / 16.4 ms in all; Gemma 3's 2048-wide
// down projection 0.85-0.88x at 512 rows against 256.
inline int64_t row_block(int64_t K) { return K * 2 * 512 <= (3 << 19) ? 512 : 256; }

int64_t amx_num_items(int64_t M, int64_t nb, int64_t K) {
  return (nb + 1) / 2 * ((M + row_block(K) - 1) / row_block(K));
}

void amx_items(const uint16_t* a, const QuantView& w, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
               const float* bias, int64_t begin, int64_t end) {
  alignas(64) float scratch[256];
  const int64_t nb = w.nb, m_pad = (M + 15) / 16 * 16, pairs = (nb + 1) / 2, kc = K / 32, rb = row_block(K);
  // two pairs' tiles, 64-byte aligned: this item's, and the next one's, dequantized during this item's products
  const std::unique_ptr<uint16_t[]> room(new uint16_t[4 * kc * 512 + 32]);
  uint16_t* cur = room.get() + (32 - reinterpret_cast<uintptr_t>(room.get()) / 2 % 32) % 32;
  uint16_t* next = cur + 2 * kc * 512;
  int64_t have = -1;  // the pair whose tiles are in cur
  amx_dequant::PairJob side;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t nbk = item % pairs * 2, first = item / pairs * rb, last = std::min(first + rb, m_pad);
    const bool two_n = nbk + 1 < nb;
    if (have != nbk) {  // this pair's tiles into next (the rest of the job the item before started, or all of it)
      if (side.total == 0 || side.b != nbk) side.start(w, nbk, next);
      side.finish();
      std::swap(cur, next);
      have = nbk;
    }
    side = {};
    const int64_t after = item + 1 < end ? (item + 1) % pairs * 2 : nbk;
    if (after != nbk) side.start(w, after, next);
    for (int64_t m0 = first; m0 < last; m0 += 32) {
      const bool two_m = m0 + 16 < m_pad;
      if (two_m && two_n) block<true, true>(a, cur, y, ldy, M, N, K, m0, nbk, bias, scratch, side);
      else if (two_m) block<true, false>(a, cur, y, ldy, M, N, K, m0, nbk, bias, scratch, side);
      else if (two_n) block<false, true>(a, cur, y, ldy, M, N, K, m0, nbk, bias, scratch, side);
      else block<false, false>(a, cur, y, ldy, M, N, K, m0, nbk, bias, scratch, side);
    }
  }
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t group, double c, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(tiles_granted(), "amx_linear: the kernel did not get AMX tile state from the OS (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  const QuantView w = quant_view(quants, scales, offsets, bits, group, c, K);
  TORCH_CHECK(n > 0 && n <= w.nb * 16 && n > (w.nb - 1) * 16, "n=", n, " does not fit ", w.nb, " blocks of 16");
  TORCH_CHECK(w.table == nullptr, "amx_linear: table formats (IQ4) stay on the int8 kernel");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == n && bias->is_contiguous(),
                "bias must be contiguous float32 [n]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
  const int64_t m_pad = (M + 15) / 16 * 16;
  auto a = torch::empty({m_pad, K}, x.options().dtype(torch::kBFloat16));
  auto* ap = reinterpret_cast<uint16_t*>(a.data_ptr());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m_pad, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (m < M) amx_round_row(xp + m * K, K, ap + m * K);
      else std::memset(ap + m * K, 0, K * sizeof(uint16_t));  // rows past M: zeros
    }
  });
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, amx_num_items(M, w.nb, K), 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    amx_items(ap, w, yp, n, M, n, K, b, begin, end);
    amx_release();
  });
  return y;
}

#else  // built for a CPU without AMX-BF16: the op exists and says why it cannot run; the pieces are never called

bool amx_ready() { return false; }
void amx_configure() {}
void amx_release() {}
void amx_round_row(const float*, int64_t, uint16_t*) {}
int64_t amx_num_items(int64_t, int64_t, int64_t) { return 0; }
void amx_items(const uint16_t*, const QuantView&, float*, int64_t, int64_t, int64_t, int64_t, const float*,
               int64_t, int64_t) {}

torch::Tensor amx_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, double, int64_t,
                         c10::optional<torch::Tensor>) {
  throw std::runtime_error("amx_linear: this build has no AMX-BF16 (the CPU it was built for lacks it)");
}

#endif
