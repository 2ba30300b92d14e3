// Part of quant_linear.cpp, included there inside its anonymous namespace after tile() (quant_tile_*.h):
// block_tiles, the tiles of rows that pass over one block of 16 outputs, and the tile bodies it takes.

// tile() of one format, for block_tiles (AVX2 has ByteTiles below too: byte records, widened 5-bit or Q6_K's).
template <int BITS, int G, typename ST, int OFF>
struct FormatTiles {
  static constexpr int kRows = tile_rows<BITS, G, OFF>();
  static constexpr bool kPairs = BITS != 8;  // block_tiles: a rest of 1 row as tiles of 2 (8-bit: 0.95-0.98x)
  template <int MT>
  static void run(const uint8_t* qr, const ST* sr, const ST* orr, float c, int64_t ng, const int8_t* xq,
                  const float* xd, const int32_t* xs, const float* xt, int64_t K, float* out, int64_t ldo) {
    tile<MT, BITS, G, ST, OFF>(qr, sr, orr, c, ng, xq, xd, xs, xt, K, out, ldo);
  }
};

#if defined(DI_AVX512)  // widen5's records are 8-bit records (quant_tile_avx512.h)
template <int G, typename ST, int OFF>
using Widened5Tiles = FormatTiles<8, G, ST, OFF>;
#elif defined(DI_WIDEN5)  // AVX2 without VNNI: tile_wide<5> reads them (quant_tile_avx2.h)
#ifndef DI_WIDE5_TILE
#define DI_WIDE5_TILE 3
#endif
// tile_wide over byte records (quant_tile_avx2.h): BITS 5, widen5's; BITS 6, 8-bit records whose quants are all below
// 64 (GGUF Q6_K), multiplied unsigned without the sign flip
template <int BITS, int G, typename ST, int OFF>
struct ByteTiles {
  static constexpr int kRows = DI_WIDE5_TILE;
  static constexpr bool kPairs = true;
  template <int MT>
  static void run(const uint8_t* qr, const ST* sr, const ST* orr, float c, int64_t ng, const int8_t* xq,
                  const float* xd, const int32_t* xs, const float* xt, int64_t K, float* out, int64_t ldo) {
    tile_wide<MT, BITS, G, ST, OFF>(qr, sr, orr, c, ng, xq, xd, xs, xt, K, out, ldo);
  }
};
template <int G, typename ST, int OFF>
using Widened5Tiles = ByteTiles<5, G, ST, OFF>;
// -DDI_SMALL8_TILES=0 reads Q6_K's records as any 8-bit records (benchmarks/quant_linear_rows.py compares)
#ifndef DI_SMALL8_TILES
#define DI_SMALL8_TILES 1
#endif
#if DI_SMALL8_TILES
#define DI_SMALL8 1
template <int G, typename ST, int OFF>
using Small8Tiles = ByteTiles<6, G, ST, OFF>;
#endif
#endif

// The M rows of one block of 16 outputs (its records at qr): tiles of Tiles::kRows rows (kMaxTile, or 3 for AVX2's
// 16-lane tiles), then one tile of the rest (one pass over the weight block per tile); every row runs the same
// per-row sequence whatever tile it falls in. With tiles of 3 and Tiles::kPairs, a rest of 1 row goes as two tiles
// of 2 instead (the last full tile's rows and it): a one-row tile pays a pass's fixed work for a single row. SmolLM2's
// and Gemma 3's 4-, 5- and 6-bit layers at 4 / 7 / 10 rows, 2 threads: 1.01-1.06x (benchmarks/quant_linear_rows.py
// --rows 4,7,10 against the parent's sources); the Q8_0 head 0.95-0.98x, so not for full 8-bit records.
template <class Tiles, typename ST>
void block_tiles(const uint8_t* qr, const ST* sr, const ST* orr, float c, int64_t ng, int64_t K, const int8_t* xq,
                 const float* xd, const int32_t* xs, const float* xt, int64_t M, float* out, int64_t ldo) {
  constexpr int kTile = Tiles::kRows;
  static_assert(kTile <= kMaxTile, "the rest below has cases up to kMaxTile - 1 rows");
  const int64_t full = Tiles::kPairs && kTile == 3 && M >= 4 && M % 3 == 1 ? M - 4 : M;  // rows in tiles of kTile
  int64_t m = 0;
  for (; m + kTile <= full; m += kTile)
    Tiles::template run<kTile>(qr, sr, orr, c, ng, xq + m * K, xd + m * (K / 32), xs + m * (K / 16),
                               xt + m * (3 * K / 32), K, out + m * ldo, ldo);
#if defined(DI_AVX512) || defined(DI_AVX2)
  if constexpr (kTile == 3 && Tiles::kPairs) {
    for (; full != M && m < M; m += 2)
      Tiles::template run<2>(qr, sr, orr, c, ng, xq + m * K, xd + m * (K / 32), xs + m * (K / 16),
                             xt + m * (3 * K / 32), K, out + m * ldo, ldo);
  }
  auto rest = [&](auto rows) {
    Tiles::template run<decltype(rows)::value>(qr, sr, orr, c, ng, xq + m * K, xd + m * (K / 32), xs + m * (K / 16),
                                               xt + m * (3 * K / 32), K, out + m * ldo, ldo);
  };
  switch (M - m) {
#if defined(DI_AVX512)
    case 7: rest(std::integral_constant<int, 7>{}); break;
    case 6: rest(std::integral_constant<int, 6>{}); break;
    case 5: rest(std::integral_constant<int, 5>{}); break;
    case 4: rest(std::integral_constant<int, 4>{}); break;
#endif
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 1: rest(std::integral_constant<int, 1>{}); break;
    default: break;
  }
#endif
}
