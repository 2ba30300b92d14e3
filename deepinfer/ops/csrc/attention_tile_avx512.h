// Query tiles for attention.cpp's paged attention (AVX-512; included by attention_tiles.h only, after
// attention_avx512.h): R consecutive queries of one sequence (one block table, positions p .. p + R - 1) and the G
// query heads of one KV head, block by block. Each block's keys and values are read once for the R queries (a long
// prompt's queries each streamed their whole context from L2, or from L3 once it outgrew L2) and each key is widened
// once. Every query runs its decode row's arithmetic in its order: the segments are its own (the block's keys
// between its window start and its position), a score's bits depend on its query and key only (head_scores16), the
// softmax step sees its segment's scores from the segment's first, and each accumulator lane is rescaled once per
// segment and then takes one FMA per key in key order. So a query gets the same bits in a tile as alone.
#pragma once
#if defined(__AVX512F__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <immintrin.h>

// Pieces per sweep of a value pass that carries NH heads' accumulators: all C where NH x P + P fits in 28 registers,
// else the widest power of two that does.
template <int NH, int C>
constexpr int tile_value_pieces() {
  int n = C;
  while (n > 1 && NH * n + n > 28) n /= 2;
  return n;
}

// acc[hd] = acc[hd] * rescale[hd], then acc[hd] += w[hd][i] * v_i for i = 0..count-1 in order, for NH heads that
// read the same values (v_i at vb + i * stride); the accumulators of P pieces at a time in registers.
template <int DIM, int NH, typename KV>
__attribute__((always_inline)) static inline void value_pass(const float* const* w, float* const* acc,
                                                             const float* rescale, const KV* __restrict__ vb,
                                                             int64_t count, int64_t stride) {
  constexpr int C = DIM / 16, P = tile_value_pieces<NH, C>();
  for (int c0 = 0; c0 < C; c0 += P) {
    __m512 a[NH][P];
    for (int hd = 0; hd < NH; ++hd)
      for (int c = 0; c < P; ++c)
        a[hd][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[hd] + 16 * (c0 + c)), _mm512_set1_ps(rescale[hd]));
    for (int64_t i = 0; i < count; ++i) {
      __m512 vr[P];
      load_pieces<P>(vb + i * stride + 16 * c0, vr);
      for (int hd = 0; hd < NH; ++hd) {
        const __m512 p = _mm512_set1_ps(w[hd][i]);
        for (int c = 0; c < P; ++c) a[hd][c] = _mm512_fmadd_ps(p, vr[c], a[hd][c]);
      }
    }
    for (int hd = 0; hd < NH; ++hd)
      for (int c = 0; c < P; ++c) _mm512_storeu_ps(acc[hd] + 16 * (c0 + c), a[hd][c]);
  }
}

// One tile: queries r = 0..R-1 with len0 + r keys each (from max(0, len0 + r - window) with a window), head slot
// hd = r * GROUP + g: its query at q + r * q_stride + g * DIM, its scores at scores + hd * block_size, accumulators
// at acc + hd * DIM, running max / sum at row_max[hd] / row_sum[hd]; acc holds the unnormalised sums at the end.
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
  const float* w[NH];
  float* a[NH];
  for (int hd = 0; hd < NH; ++hd) a[hd] = acc + hd * DIM;
  alignas(64) float wide[16 * DIM];
  for (int64_t block = first0 / block_size; block * block_size < last; ++block) {
    const int64_t lo = block * block_size, hi = lo + block_size;
    const int64_t s = std::max(lo, first0), e = std::min(hi, last);  // the keys of this block any query reads
    const int64_t row0 = (table[block] * block_size + s - lo) * kv_heads + h;
    const KV* kb = kp + row0 * DIM;
    const KV* vb = vp + row0 * DIM;
    const KV *nk = nullptr, *nv = nullptr;
    int64_t ahead = 0;
    if (hi < last) {  // the next block's rows of this head, asked for while this one is scored
      const int64_t next = table[block + 1] * block_size * kv_heads + h;
      nk = kp + next * DIM;
      nv = vp + next * DIM;
      ahead = std::min(block_size, last - hi);
    }
    for (int64_t i0 = 0; i0 < e - s; i0 += 16) {  // every head's scores of keys s..e-1 (some unused by a query)
      const int n = (int)std::min<int64_t>(16, e - s - i0);
      widen_keys16<DIM, KV, LOC>(kb, i0, n, stride, wide, nk, nv, ahead);
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < GROUP; ++g)
          head_scores16<DIM>(q + r * q_stride + g * DIM, wide, n, scale, scores + (r * GROUP + g) * block_size + i0);
    }
    for (int64_t i = e - s; i < ahead; ++i) prefetch_kv_row<DIM, LOC>(nk + i * stride, nv + i * stride);
    float rescale[NH];
    int64_t from[R], to[R];  // query r's segment of this block: keys from[r]..to[r]-1
    bool same = true;
    for (int r = 0; r < R; ++r) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, len0 + r - window) : 0;
      from[r] = std::max(lo, first);
      to[r] = std::min(hi, len0 + r);
      same = same && from[r] == s && to[r] == e;
      for (int g = 0; g < GROUP; ++g) w[r * GROUP + g] = scores + (r * GROUP + g) * block_size + (from[r] - s);
    }
    if (same) {  // the whole tile reads the same keys: softmax steps side by side, each value row widened once
      softmax_heads16<NH>(scores, block_size, e - s, row_max, row_sum, rescale);
      value_pass<DIM, NH, KV>(w, a, rescale, vb, e - s, stride);
    } else {  // the first or last block: query by query over its own segment
      for (int r = 0; r < R; ++r) {
        if (from[r] >= to[r]) continue;
        for (int g = 0; g < GROUP; ++g) {
          const int hd = r * GROUP + g;
          rescale[hd] = softmax_segment16(scores + hd * block_size + (from[r] - s), to[r] - from[r], row_max[hd],
                                          row_sum[hd]);
        }
        value_pass<DIM, GROUP, KV>(w + r * GROUP, a + r * GROUP, rescale + r * GROUP, vb + (from[r] - s) * stride,
                                   to[r] - from[r], stride);
      }
    }
  }
}

#endif
