// Query tiles of attention.cpp's paged attention (AVX-512 and AVX2; included by attention.cpp only, after
// attend_piece and item_at, which they use): decode_attention plans them, tiles_of runs a plan's items with them.
// DI_ATTN_TILE consecutive rows of one sequence per tile, for groups of up to 4 query heads per KV head (with
// AVX-512 a larger tile's accumulators outgrow the registers of the value pass). AVX-512, 4 rows: SmolLM2's
// attention over a 2,048-token prompt on one thread of the 2-core Zen 4 EPYC 1.19x faster than a query at a time,
// 2 rows 1.22x, 8 rows 0.99x (before softmax_heads16 and the unmasked whole pieces, with which 4 rows give 1.40x).
// AVX2, 4 rows, a 512 / 2,048-token prompt on the 2-core Zen 3 EPYC: 1.03-1.19x, 2 rows 1.05-1.12x, 8 rows 1.03-1.17x
// (benchmarks/prompt_attention.py).
// Rows outside any tile run the decode item (without its request for the next item's first rows).
#pragma once
#if defined(__AVX512F__) || defined(DI_ATTN_AVX2)
#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include "attention_tile_avx512.h"
#else
#include "attention_tile_avx2.h"
#endif

#ifndef DI_ATTN_TILE
#define DI_ATTN_TILE 4
#endif
// Rows n and n + 1 read the same keys but one: the next position of one sequence (lens one apart) through the same
// blocks (width 0: one table for all rows).
static bool next_position(const int64_t* tables, int64_t width, const int64_t* lens, int64_t block_size, int64_t n) {
  if (lens[n + 1] != lens[n] + 1) return false;
  const int64_t blocks = (lens[n + 1] + block_size - 1) / block_size;
  return width == 0 || std::equal(tables + n * width, tables + n * width + blocks, tables + (n + 1) * width);
}

template <int DIM, int GROUP, typename KV>
static void tile_item(const DecodeAttention& a, int64_t n0, int64_t h, float* scores, float* acc, float* row_max,
                      float* row_sum) {
  constexpr int R = DI_ATTN_TILE;
  const int64_t head0 = n0 * a.heads + h * GROUP;
  auto run = [&](auto loc) {  // the last row's table: it covers every row's blocks, and the rows agree on theirs
    attend_tile<DIM, GROUP, R, KV, decltype(loc)::value>(
        a.q + head0 * DIM, a.heads * DIM, static_cast<const KV*>(a.k_cache), static_cast<const KV*>(a.v_cache),
        a.tables + (n0 + R - 1) * a.width, a.lens[n0], a.window, a.block_size, a.kv_heads, h, a.scale, scores, acc,
        row_max, row_sum);
  };
  if (a.prefetch == 3) run(std::integral_constant<int, 3>{});
  else run(std::integral_constant<int, 2>{});
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GROUP; ++g) {
      float* o = a.out + (head0 + r * a.heads + g) * DIM;
      for (int d = 0; d < DIM; ++d) o[d] = acc[(r * GROUP + g) * DIM + d] / row_sum[r * GROUP + g];
    }
}

template <typename KV>
static void tiles_of(const DecodeAttention& a, int64_t begin, int64_t end, float* scratch) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim;
  float* scores = scratch;
  float* acc = scores + a.per * a.block_size;
  float* row_max = acc + a.per * dim;
  float* row_sum = row_max + a.per;
  for (int64_t slot = begin; slot < end; ++slot) {
    const int64_t item = item_at(slot, a.items), h = item % a.kv_heads;
    const auto [n, count] = a.tiles[item / a.kv_heads];
    if (count == 1) {  // a row alone: the decode item
      const int64_t len = a.lens[n], first = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
      attend_piece<KV>(a, n * a.heads + h * group, n, h, group, first, len, scores, acc, row_max, row_sum, nullptr,
                       nullptr, 0);
      continue;
    }
    auto by_group = [&](auto dim_c) {
      constexpr int D = decltype(dim_c)::value;
      switch (group) {
        case 1: tile_item<D, 1, KV>(a, n, h, scores, acc, row_max, row_sum); break;
        case 2: tile_item<D, 2, KV>(a, n, h, scores, acc, row_max, row_sum); break;
        case 3: tile_item<D, 3, KV>(a, n, h, scores, acc, row_max, row_sum); break;
        default: tile_item<D, 4, KV>(a, n, h, scores, acc, row_max, row_sum); break;
      }
    };
    if (dim == 64) by_group(std::integral_constant<int, 64>{});
    else if (dim == 128) by_group(std::integral_constant<int, 128>{});
    else by_group(std::integral_constant<int, 256>{});
  }
}
#endif
