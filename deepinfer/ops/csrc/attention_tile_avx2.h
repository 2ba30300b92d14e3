// Query tiles for attention.cpp's paged attention on AVX2 (included by attention_tiles.h only, after
// attention_avx2.h): R consecutive queries of one sequence (one block table, positions p .. p + R - 1) and the G
// query heads of one KV head, block by block: the R queries take their decode steps (block_step) on a block one after
// the other, each on its own segment of it (its window start and its position cut the first and last blocks), so the
// block is read from memory once for the R queries and from L1/L2 after that, where alone each query streamed its
// whole context (from L2, or from L3 once a prompt's K and V outgrow L2). Each query's segments and their order are
// those it has alone, and block_step is the same code: a query gets the same bits in a tile as alone. Widening a
// block's keys and values to float32 once for the tile (as the AVX-512 tile does, 16 keys at a time) was slower
// here: 0.77-0.93x a query at a time against 1.03-1.19x without (benchmarks/prompt_attention.py, Zen 3).
#pragma once
#if defined(DI_ATTN_AVX2)
#include <algorithm>
#include <cmath>
#include <cstdint>

// One tile, with the AVX-512 tile's arguments and results (attention_tile_avx512.h), which tile_item reads.
template <int DIM, int GROUP, int R, typename KV, int LOC>
__attribute__((noinline)) static void attend_tile(
    const float* __restrict__ q, int64_t q_stride, const KV* __restrict__ kp, const KV* __restrict__ vp,
    const int64_t* __restrict__ table, int64_t len0, int64_t window, int64_t block_size, int64_t kv_heads, int64_t h,
    float scale, float* __restrict__ scores, float* __restrict__ acc, float* __restrict__ row_max,
    float* __restrict__ row_sum) {
  constexpr int NH = R * GROUP;
  const int64_t stride = kv_heads * DIM, last = len0 + R - 1;
  const int64_t first0 = window > 0 ? std::max<int64_t>(0, len0 - window) : 0;
  for (int hd = 0; hd < NH; ++hd) { row_max[hd] = -INFINITY; row_sum[hd] = 0.f; }
  for (int64_t i = 0; i < NH * DIM; ++i) acc[i] = 0.f;
  for (int64_t block = first0 / block_size; block * block_size < last; ++block) {
    const int64_t lo = block * block_size, hi = lo + block_size;
    const int64_t s = std::max(lo, first0), e = std::min(hi, last);  // the keys of this block any query reads
    const int64_t row0 = (table[block] * block_size + s - lo) * kv_heads + h;
    if (hi < last) {  // the next block's rows of this head, asked for while this one is read
      const int64_t next = table[block + 1] * block_size * kv_heads + h;
      for (int64_t i = 0; i < std::min(block_size, last - hi); ++i)
        prefetch_kv_row<DIM, LOC>(kp + (next + i * kv_heads) * DIM, vp + (next + i * kv_heads) * DIM);
    }
    const KV* kb = kp + row0 * DIM;
    const KV* vb = vp + row0 * DIM;
    for (int r = 0; r < R; ++r) {  // query r's segment of this block: keys from..to-1
      const int64_t first = window > 0 ? std::max<int64_t>(0, len0 + r - window) : 0;
      const int64_t from = std::max(lo, first), to = std::min(hi, len0 + r);
      if (from >= to) continue;
      const int64_t off = (from - s) * stride, hd = r * GROUP;
      block_step<DIM, GROUP, KV>(q + r * q_stride, kb + off, vb + off, to - from, stride, GROUP, block_size, scale,
                                 scores + hd * block_size, acc + hd * DIM, row_max + hd, row_sum + hd);
    }
  }
}

#endif
