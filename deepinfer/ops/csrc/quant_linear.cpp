// Linear layers computed on block-quantized weights (GGUF's legacy and K formats, our int8/int4), as llama.cpp does:
// activations are rounded to int8 per row and 32-value block, integer dot products per weight group, float scales.
//
// Packed weight of one layer (N output rows, padded to a multiple of 16, K inputs, groups of G values along K):
//   quants  [N/16][K/G][16*G*BITS/8] bytes. A group record is 64-byte pieces; in each piece, bytes 4j..4j+3 belong
//           to output row j of the 16 (lane j of a 512-bit register): 4 consecutive k for 8-bit quants; for 4-bit
//           quants piece p holds k = 8p..8p+3 in the low nibbles and 8p+4..8p+7 in the high nibbles. 5-bit quants
//           (G = 32) are their low 4 bits as 4-bit quants (256 bytes), then 8 bytes of fifth bits per register
//           of nibbles: for piece p, bit i of bytes 256+16p.. is byte i's low nibble's, of 256+16p+8.. its high's.
//   scales  [N/16][K/G][16], fp16 or fp32; offsets the same (affine formats), or offset = c * scale (symmetric).
//   A weight is w = scale * u + offset with u the unsigned quant (0..15, 0..31 or 0..255). A table format (4-bit,
//   symmetric: GGUF's IQ4_NL / IQ4_XS) passes 16 bytes T as its offsets; its nibbles index them: u = T[nibble].
// Activations x [M, K] float32 -> xq int8 (round-to-nearest-even of x / d, d = max|x| / 127 per 32 values),
// xd [M, K/32] the d's, xs [M, K/16] sums of xq per 16 values, xt [M, 3K/32] the offset terms' factors
// d * float(xsum) per 16 values then per 32 (once per row, not once per block of outputs). Then per output (m, n),
// over groups g in order, isum = sum u * xq (exact, int32):
//   stored offsets (affine formats):  acc += float(isum) * (scale * d) ; acc += offset * (d * float(xsum))
//   symmetric, integer c (Q8_0, Q4_0, Q5_0, Q6_K, Q3_K, IQ4, int8):  acc += float(isum + c * xsum) * (scale * d)
//   symmetric, other c (the split head's first pass):  the first form with offset = c * scale
// Folding an integer c into the integer sum is exact, drops one FMA per row and group and the cancellation between
// the two large terms (u x and c x, c = -128 for Q8_0).
// Every output row of every activation row runs exactly this sequence, whatever M, the tile it falls in or the
// thread that runs it: a row's result does not depend on the rest of the batch (batch invariance).
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <memory>

#include "kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>

#include "bit_bytes_avx2.h"
#endif

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DI_AVX512 1
constexpr const char* kIsa = "avx512-vnni";
constexpr int kMaxTile = 8;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define DI_AVX2 1
#define DI_AVXVNNI 1
constexpr const char* kIsa = "avx2-vnni";
constexpr int kMaxTile = 4;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DI_AVX2 1
constexpr const char* kIsa = "avx2";
constexpr int kMaxTile = 4;
#else
constexpr const char* kIsa = "generic";
constexpr int kMaxTile = 1;
#endif

// How a group's offset enters (the arithmetic at the top): stored per group, folded into the integer sum (a
// symmetric format's integer c), or c * scale as a float (a symmetric c that is not an integer). kTable: folded, and
// the 4-bit quants index the table passed as the offsets pointer.
enum Offsets { kStored, kFolded, kScaled, kTable };

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float scalar_of(const float* p, int i) { return p[i]; }
inline float scalar_of(const uint16_t* p, int i) { return half_to_float(p[i]); }

// The unsigned quant of lane j, value i (0 <= i < G) of one group record.
template <int BITS>
inline int quant_at(const uint8_t* rec, int j, int i) {
  if (BITS == 8) return rec[64 * (i / 4) + 4 * j + i % 4];
  const uint8_t b = rec[64 * (i / 8) + 4 * j + i % 4];
  const int nibble = (i % 8) < 4 ? (b & 0x0F) : (b >> 4);
  if (BITS == 4) return nibble;
  const int bit = 4 * j + i % 4;  // byte of the piece; its fifth bit in the plane after the 256 bytes of nibbles
  return nibble | (((rec[256 + 16 * (i / 8) + 8 * ((i % 8) / 4) + bit / 8] >> (bit % 8)) & 1) << 4);
}

// sum(xq) over group g of activation row m: one 16-value sum, or two for 32-value groups.
template <int G>
inline int32_t group_xsum(const int32_t* xs, int64_t m, int64_t K, int64_t g) {
  const int32_t* row = xs + m * (K / 16);
  return G == 32 ? row[2 * g] + row[2 * g + 1] : row[g];
}

// d * float(sum(xq)) over group g of activation row m, as quantize_row left it.
template <int G>
inline const float* group_term(const float* xt, int64_t m, int64_t K, int64_t g) {
  return xt + m * (3 * K / 32) + (G == 32 ? K / 16 + g : g);
}

#if defined(DI_AVX512) || defined(DI_AVX2)
// The weights stream from memory once per token: ask for the records kPrefetch groups ahead (past this block's
// last group lies the next block's first, contiguous), so the memory system works ahead of the dot products.
// Prefetches never fault and change no value.
#ifndef DI_PREFETCH
#define DI_PREFETCH 8
#endif
constexpr int kPrefetch = DI_PREFETCH;
template <int QB, typename ST>
inline void prefetch_ahead(const uint8_t* rec, const ST* s, const ST* o) {
  for (int line = 0; line < QB; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch * QB + line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetch * 16), _MM_HINT_T0);
  if (o) _mm_prefetch(reinterpret_cast<const char*>(o + kPrefetch * 16), _MM_HINT_T0);
}
#endif

#if defined(DI_AVX512)
#include "quant_tile_avx512.h"
#include "quantize_row_avx512.h"

#elif defined(DI_AVX2)
#include "quant_tile_avx2.h"
#include "quantize_row_avx2.h"

#else
#include "quant_tile_generic.h"
#endif

#if !defined(DI_AVX2)  // rows per tile (quant_tile_avx2.h has its own)
template <int BITS, int G, int OFF>
constexpr int tile_rows() { return kMaxTile; }
#endif

}  // namespace

// One row of x rounded to int8 per 32 values, no FMA contraction. The block's max is exact in any order, the
// divisions are IEEE in a vector as in a scalar, and rounding to nearest even then converting is what
// nearbyint then (int) does: the AVX-512 and AVX2 bodies (quantize_row_avx512.h, quantize_row_avx2.h) give the
// portable body's bits (tests/ops compares the builds). A NaN is skipped by the max in all three
// (std::max(acc, NaN) keeps acc; vmaxps returns its second operand).
void quantize_row(const float* x, int64_t K, int8_t* xq, float* xd, int32_t* xs, float* xt) {
  const int64_t nb = K / 32;
#if defined(DI_AVX512) || defined(DI_AVX2)
  int64_t b0 = 0;
  for (; b0 + kRoundBlocks <= nb; b0 += kRoundBlocks)
    quantize_blocks<true>(x + 32 * b0, xq + 32 * b0, xd + b0, xs + 2 * b0, xt + 2 * b0, xt + K / 16 + b0,
                          kRoundBlocks);
  if (b0 < nb)
    quantize_blocks<false>(x + 32 * b0, xq + 32 * b0, xd + b0, xs + 2 * b0, xt + 2 * b0, xt + K / 16 + b0,
                           (int)(nb - b0));
#else
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int8_t* q = xq + 32 * b;
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 32; ++i) {
      const int qi = (int)std::nearbyint(v[i] * id);
      q[i] = (int8_t)qi;
      (i < 16 ? s0 : s1) += qi;
    }
    xd[b] = d;
    xs[2 * b] = s0;
    xs[2 * b + 1] = s1;
    xt[2 * b] = d * (float)s0;
    xt[2 * b + 1] = d * (float)s1;
    xt[K / 16 + b] = d * (float)(s0 + s1);
  }
#endif
}

namespace {

#include "block_tiles.h"  // FormatTiles, ByteTiles (Widened5Tiles, Small8Tiles), block_tiles

// 5-bit blocks with many rows: the block's records widened once (widen5), then tiles over the widened records
// (Widened5Tiles: AVX-512's 8-bit tiles; AVX2 without VNNI, tile_wide<5>). The same integer sums and the same float
// steps, so the same bits as the 5-bit tiles; the unpacking is paid once per block instead of once per tile of rows.
// - AVX-512 (two masked adds per 64 bytes besides the nibbles'): Gemma 3's 5-bit layers at 64 and 512 rows
//   1.04-1.08x over the 5-bit tiles (benchmarks/quant_linear_rows.py --shapes g_qkv,g_gate_up --variants
//   "DI_WIDEN5_ROWS=100000;DI_WIDEN5_ROWS=16"), 0.95-0.96x of a copy stored widened to 8 bits; at 1 row the 5-bit
//   records stream 1.4x faster than that copy, which is what the 5 bits are for.
// - AVX2 without VNNI (a shuffle, a compare and two logic ops per 32 fifth bits; 16 lanes a pass instead of two
//   halves): on one Zen 3 thread 1.03-1.06x at 2 rows, 1.10-1.14x at 4, 1.29x at 8, 1.30-1.41x at 16 and 64,
//   1.48-1.65x at 512; 0.95-1.06x at 1 row (so from 2 rows). 3 rows a tile: 2 gave 1.02-1.07x less, 4 spilled.
// The buffer has room past its end for the tiles' prefetches, which read kPrefetch records ahead: outside it they
// pulled unrelated lines into L1 (AVX-512: 0.90x of the 8-bit copy instead of 0.95x).
#ifndef DI_WIDEN5_ROWS
#if defined(DI_AVX512)
#define DI_WIDEN5_ROWS 16
#else
#define DI_WIDEN5_ROWS 2
#endif
#endif
constexpr int64_t kWiden5Rows = DI_WIDEN5_ROWS;

template <int BITS, int G, typename ST, int OFF, bool SMALL = false>
void block_rows(const uint8_t* q, const ST* s, const ST* o, float c, int64_t K, const int8_t* xq, const float* xd,
                const int32_t* xs, const float* xt, int64_t M, float* out, int64_t ldo, int64_t begin, int64_t end,
                int64_t col0) {
  const int64_t ng = K / G;
  const int64_t qb = 16 * G * BITS / 8;
#if defined(DI_WIDEN5)
  // not value-initialised: every byte a tile reads is written by widen5 first (the room past it is only prefetched)
  const std::unique_ptr<uint8_t[]> wide(BITS == 5 && M >= kWiden5Rows ? new uint8_t[16 * K + 512 * (kPrefetch + 1)]
                                                                       : nullptr);
#endif
  for (int64_t b = begin; b < end; ++b) {
    const uint8_t* qr = q + b * ng * qb;
    const ST* sr = s + b * ng * 16;
    const ST* orr = OFF == kStored ? o + b * ng * 16 : OFF == kTable ? o : nullptr;
    float* ob = out + 16 * (b - col0);
#if defined(DI_SMALL8)
    if constexpr (SMALL) {
      block_tiles<Small8Tiles<G, ST, OFF>>(qr, sr, orr, c, ng, K, xq, xd, xs, xt, M, ob, ldo);
      continue;
    }
#endif
#if defined(DI_WIDEN5)
    if constexpr (BITS == 5 && G == 32) {
      if (wide) {
        widen5(qr, ng, wide.get());
        block_tiles<Widened5Tiles<G, ST, OFF>>(wide.get(), sr, orr, c, ng, K, xq, xd, xs, xt, M, ob, ldo);
        continue;
      }
    }
#endif
    block_tiles<FormatTiles<BITS, G, ST, OFF>>(qr, sr, orr, c, ng, K, xq, xd, xs, xt, M, ob, ldo);
  }
}

// Many rows (a prompt) go in chunks of kRowChunk: a chunk's activations stay in L2 while this thread's weight
// blocks pass over them (all rows at once stream the activations from L3 for every block of outputs). A multiple
// of every tile height, so rows fall in the same tiles; and a row's result does not depend on its tile anyway.
// Measured (SmolLM2's four linear shapes at 2,048 rows, 2 threads): 61.2 ms unchunked, 57.3 / 55.1 / 56.2 ms in
// chunks of 64 / 128 / 256 rows.
#ifndef DI_ROW_CHUNK
#define DI_ROW_CHUNK 128
#endif
constexpr int64_t kRowChunk = DI_ROW_CHUNK;

template <int BITS, int G, typename ST, int OFF, bool SMALL = false>
void blocks(const uint8_t* q, const ST* s, const ST* o, float c, int64_t K, const int8_t* xq, const float* xd,
            const int32_t* xs, const float* xt, int64_t M, float* out, int64_t ldo, int64_t begin, int64_t end,
            int64_t col0) {
  for (int64_t m = 0; m < M; m += kRowChunk)
    block_rows<BITS, G, ST, OFF, SMALL>(q, s, o, c, K, xq + m * K, xd + m * (K / 32), xs + m * (K / 16),
                                 xt + m * (3 * K / 32), std::min(kRowChunk, M - m), out + m * ldo, ldo, begin, end,
                                 col0);
}

template <typename ST, int OFF>
void blocks_of(const QuantView& w, const int8_t* xq, const float* xd, const int32_t* xs, const float* xt, int64_t M,
               float* out, int64_t ldo, int64_t begin, int64_t end, int64_t col0) {
  const auto* s = static_cast<const ST*>(w.scales);
  const auto* o = static_cast<const ST*>(w.offsets);
  if constexpr (OFF == kTable) {  // the table reaches the tiles in the offsets' place
    blocks<4, 32, ST, kTable>(w.quants, s, reinterpret_cast<const ST*>(w.table), w.c, w.k, xq, xd, xs, xt, M, out,
                              ldo, begin, end, col0);
  } else {
    if (w.bits == 4 && w.group == 32) return blocks<4, 32, ST, OFF>(w.quants, s, o, w.c, w.k, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
    if (w.bits == 5 && w.group == 32) return blocks<5, 32, ST, OFF>(w.quants, s, o, w.c, w.k, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
#if defined(DI_SMALL8)
    if (w.small && w.group == 32) return blocks<8, 32, ST, OFF, true>(w.quants, s, o, w.c, w.k, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
    if (w.small && w.group == 16) return blocks<8, 16, ST, OFF, true>(w.quants, s, o, w.c, w.k, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
#endif
    if (w.bits == 8 && w.group == 32) return blocks<8, 32, ST, OFF>(w.quants, s, o, w.c, w.k, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
    if (w.bits == 8 && w.group == 16) return blocks<8, 16, ST, OFF>(w.quants, s, o, w.c, w.k, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
  }
}

}  // namespace

QuantView quant_view(const torch::Tensor& quants, const torch::Tensor& scales, const torch::Tensor& offsets,
                     int64_t bits, int64_t group, double c, int64_t k) {
  const bool small = bits == 6;  // 8-bit records, every quant below 64 (the caller knows: ops/quant_linear.py)
  if (small) bits = 8;
  TORCH_CHECK(((bits == 4 || bits == 5) && group == 32) || (bits == 8 && (group == 32 || group == 16)),
              "quant_linear: unsupported format bits=", bits, " group=", group);
  TORCH_CHECK(k % 32 == 0 && k % group == 0, "quant_linear: K=", k, " must be a multiple of 32 and of the group");
  const int64_t nb = quants.size(0);
  TORCH_CHECK(quants.numel() == nb * (k / group) * 16 * group * bits / 8, "quant_linear: quants do not match K=", k);
  const bool half = scales.scalar_type() == torch::kHalf;
  TORCH_CHECK(half || scales.scalar_type() == torch::kFloat, "quant_linear: scales must be float16 or float32");
  const bool table = offsets.scalar_type() == torch::kByte, aff = !table && offsets.numel() > 0;
  TORCH_CHECK(!table || (offsets.numel() == 16 && bits == 4 && group == 32 && c == std::nearbyint(c)),
              "quant_linear: a table format has 16 values, 4-bit quants in groups of 32 and an integer c");
  return QuantView{quants.data_ptr<uint8_t>(), scales.data_ptr(), aff ? offsets.data_ptr() : nullptr, (float)c,
                   bits, group, nb, k, half, aff, table ? offsets.data_ptr<uint8_t>() : nullptr, small};
}

void quant_blocks(const QuantView& w, const int8_t* xq, const float* xd, const int32_t* xs, const float* xt,
                  int64_t M, float* out, int64_t ldo, int64_t begin, int64_t end, int64_t col0) {
  if (!w.affine && w.c != std::nearbyint(w.c)) {  // a c that is not an integer: only the split head's first pass
    TORCH_CHECK(w.half && w.bits == 5 && w.group == 32, "quant_blocks: a non-integer c needs 5-bit float16 blocks");
    const auto* s = static_cast<const uint16_t*>(w.scales);
    return blocks<5, 32, uint16_t, kScaled>(w.quants, s, nullptr, w.c, w.k, xq, xd, xs, xt, M, out, ldo, begin, end,
                                            col0);
  }
  auto run = [&](auto st) {
    using ST = decltype(st);
    if (w.affine) blocks_of<ST, kStored>(w, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
    else if (w.table) blocks_of<ST, kTable>(w, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
    else blocks_of<ST, kFolded>(w, xq, xd, xs, xt, M, out, ldo, begin, end, col0);
  };
  if (w.half) run(uint16_t{});
  else run(float{});
}

QuantActs quantize_acts(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantActs a{torch::empty({M, K}, torch::kChar), torch::empty({M, K / 32}, torch::kFloat),
              torch::empty({M, K / 16}, torch::kInt), torch::empty({M, 3 * K / 32}, torch::kFloat)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.xq.data_ptr<int8_t>();
  float* dp = a.xd.data_ptr<float>();
  int32_t* sp = a.xs.data_ptr<int32_t>();
  float* tp = a.xt.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * K, K, qp + m * K, dp + m * (K / 32), sp + m * (K / 16), tp + m * (3 * K / 32));
  });
  return a;
}

// x [M, K] float32 -> [M, N] float32 (+ bias). offsets: an empty tensor for symmetric formats (offset = c * scale).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                           int64_t bits, int64_t group, double c, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quant_linear: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const QuantView w = quant_view(quants, scales, offsets, bits, group, c, K);
  auto out = torch::empty({M, w.nb * 16}, torch::kFloat);
  if (M > 0) {
    const QuantActs a = quantize_acts(x);
    float* op = out.data_ptr<float>();
    at::parallel_for(0, w.nb, 1, [&](int64_t begin, int64_t end) {
      quant_blocks(w, a.xq.data_ptr<int8_t>(), a.xd.data_ptr<float>(), a.xs.data_ptr<int32_t>(),
                   a.xt.data_ptr<float>(), M, op, w.nb * 16, begin, end);
    });
  }
  if (w.nb * 16 != n) out = out.narrow(1, 0, n).contiguous();
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

// Rows `ids` of the weight, dequantized: w = scale * u + offset, or scale * (u + c) for symmetric formats (the
// same bits as GGUF's own dequantization of Q8_0 / Q4_0 / Q5_0). The embedding lookup of a quantized table.
torch::Tensor quant_rows(torch::Tensor ids, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t group, double c, int64_t k) {
  ids = ids.contiguous().to(torch::kLong);
  const QuantView w = quant_view(quants, scales, offsets, bits, group, c, k);
  const int64_t T = ids.numel(), ng = k / group, qb = 16 * group * bits / 8;
  auto out = torch::empty({T, k}, torch::kFloat);
  const auto* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < w.nb * 16, "quant_rows: id ", id[t], " out of range");
  auto lane = [&](const void* p, int64_t i) {  // one scale or offset
    return w.half ? half_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  };
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = id[t] / 16;
      const int j = (int)(id[t] % 16);
      float* dst = out.data_ptr<float>() + t * k;
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* rec = w.quants + (b * ng + g) * qb;
        const int64_t si = (b * ng + g) * 16 + j;
        const float s = lane(w.scales, si), o = w.affine ? lane(w.offsets, si) : 0.f;
        for (int i = 0; i < group; ++i) {
          int u = bits == 4 ? quant_at<4>(rec, j, i) : bits == 5 ? quant_at<5>(rec, j, i) : quant_at<8>(rec, j, i);
          if (w.table) u = w.table[u];
          dst[g * group + i] = w.affine ? s * (float)u + o : s * (float)(u + (int)c);
        }
      }
    }
  });
  return out;
}

std::string isa() { return kIsa; }
