// The AVX-512 item loop of attention.cpp's paged attention (included by attention.cpp only).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kv_fp8.h"
#include "vexp.h"

// Asks for one cached row of K and of V (DIM values each) into cache level LOC; changes no value.
template <int DIM, int LOC, typename KV>
static inline void prefetch_kv_row(const KV* k, const KV* v) {
  for (int64_t b = 0; b < (int64_t)(DIM * sizeof(KV)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k) + b, 0, LOC);
    __builtin_prefetch(reinterpret_cast<const char*>(v) + b, 0, LOC);
  }
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "reduce16_avx512.h"  // hsum16

// Scores 16 at a time: lanes past `count` masked off in the last piece only (whole pieces are loaded and stored
// unmasked: a masked store is slow and is not forwarded to a load that follows it). Each lane's value is the same.
static inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}
static inline __m512 load16(const float* p, int64_t left) {
  return left >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(tail_mask(left), p);
}
static inline void store16(float* p, int64_t left, __m512 v) {
  if (left >= 16) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, tail_mask(left), v);
}

// The online-softmax step of NH heads whose scores (at scores + hd * block_size) cover the same count keys: each
// head's maximum and sum taken 16 scores at a time (exp_shifted written out in the sum loop, summed from the
// register), the heads' steps interleaved (one head's chain of reductions and exp waits on its latencies; heads side
// by side keep the vector units busy). rescale[hd]: the factor for the head's accumulators.
template <int NH>
__attribute__((always_inline)) static inline void softmax_heads16(float* __restrict__ scores, int64_t block_size,
                                                                  int64_t count, float* __restrict__ row_max,
                                                                  float* __restrict__ row_sum, float* rescale) {
  __m512 m[NH], sum[NH];
  for (int hd = 0; hd < NH; ++hd) m[hd] = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < count; i += 16)  // a masked-off lane loads 0 and keeps the running maximum
    for (int hd = 0; hd < NH; ++hd)
      m[hd] = _mm512_mask_max_ps(m[hd], tail_mask(count - i), m[hd], load16(scores + hd * block_size + i, count - i));
  float new_max[NH];
  for (int hd = 0; hd < NH; ++hd) new_max[hd] = std::max(row_max[hd], _mm512_reduce_max_ps(m[hd]));
  for (int hd = 0; hd < NH; ++hd) {
    rescale[hd] = std::exp(row_max[hd] - new_max[hd]);
    row_max[hd] = new_max[hd];
    sum[hd] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < count; i += 16)
    for (int hd = 0; hd < NH; ++hd) {
      float* sg = scores + hd * block_size + i;
      const __m512 e = exp_lanes(_mm512_sub_ps(load16(sg, count - i), _mm512_set1_ps(new_max[hd])));
      store16(sg, count - i, e);
      sum[hd] = _mm512_add_ps(sum[hd], count - i >= 16 ? e : _mm512_maskz_mov_ps(tail_mask(count - i), e));
    }
  for (int hd = 0; hd < NH; ++hd) row_sum[hd] = row_sum[hd] * rescale[hd] + _mm512_reduce_add_ps(sum[hd]);
}

// One head's step (the decode loop's: interleaving its G heads there was 0.97x, see attend_avx512).
__attribute__((always_inline)) static inline float softmax_segment16(float* __restrict__ sg, int64_t count,
                                                                     float& row_max, float& row_sum) {
  float rescale;
  softmax_heads16<1>(sg, 0, count, &row_max, &row_sum, &rescale);
  return rescale;
}

// N consecutive 16-value pieces of one cached row as N registers of float32 (a bfloat16 or float8 row widened on
// the way in); load_row: the whole row, DIM / 16 pieces.
template <int N>
static inline void load_pieces(const float* row, __m512* out) {
  for (int c = 0; c < N; ++c) out[c] = _mm512_loadu_ps(row + 16 * c);
}
template <int N>
static inline void load_pieces(const uint16_t* row, __m512* out) {
  for (int c = 0; c < N; ++c)
    out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c))), 16));
}
template <int N>
static inline void load_pieces(const uint8_t* row, __m512* out) {
  for (int c = 0; c < N; ++c) out[c] = fp8_widen16(row + 16 * c);
}
template <int DIM, typename KV>
static inline void load_row(const KV* row, __m512* out) { load_pieces<DIM / 16>(row, out); }

// scores[i] = scale * (q . k_i) for the n <= 16 keys widened into wide[i * DIM ..]: each key's 16 partial products
// (one chain of FMAs over the DIM / 16 pieces) summed by one hsum16 into 16 scores, a lane's bits depending on its own
// key only (the same whichever 16 keys share the call: a query tile's keys give a decode row's bits).
template <int DIM, bool FULL>
__attribute__((always_inline)) static inline void head_scores16_n(const float* __restrict__ qg,
                                                                  const float* __restrict__ wide, int n, float scale,
                                                                  float* __restrict__ out) {
  constexpr int C = DIM / 16;
  __m512 part[16];
  if constexpr (C <= 4) {  // the head's query in C registers, each key's chain in turn (SmolLM2: 1.09x over
    // the piece-by-piece form below on a 512-token prefill, the same bits)
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qg + 16 * c);
    for (int i = 0; i < 16; ++i) {
      if (FULL || i < n) {
        __m512 p = _mm512_mul_ps(qv[0], _mm512_load_ps(wide + i * DIM));
        for (int c = 1; c < C; ++c) p = _mm512_fmadd_ps(qv[c], _mm512_load_ps(wide + i * DIM + 16 * c), p);
        part[i] = p;
      } else {
        part[i] = _mm512_setzero_ps();
      }
    }
  } else {  // a long query does not fit beside 16 chains: piece by piece, all keys' chains moved on together
    // (each chain's operations and their order as above)
    const __m512 q0 = _mm512_loadu_ps(qg);
    for (int i = 0; i < 16; ++i)
      part[i] = FULL || i < n ? _mm512_mul_ps(q0, _mm512_load_ps(wide + i * DIM)) : _mm512_setzero_ps();
    for (int c = 1; c < C; ++c) {
      const __m512 qc = _mm512_loadu_ps(qg + 16 * c);
      for (int i = 0; i < 16; ++i)
        if (FULL || i < n) part[i] = _mm512_fmadd_ps(qc, _mm512_load_ps(wide + i * DIM + 16 * c), part[i]);
    }
  }
  const __m512 scores = _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scale));
  if constexpr (FULL) _mm512_storeu_ps(out, scores);
  else _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), scores);
}
// 16 keys (the usual case: whole blocks of 16) compiled without the per-key tests and the masked store (a compare
// and branch per key and head was ~8% of a prefill's attention samples); the same operations on each lane.
template <int DIM>
__attribute__((always_inline)) static inline void head_scores16(const float* __restrict__ qg,
                                                                const float* __restrict__ wide, int n, float scale,
                                                                float* __restrict__ out) {
  if (n == 16) head_scores16_n<DIM, true>(qg, wide, n, scale, out);
  else head_scores16_n<DIM, false>(qg, wide, n, scale, out);
}

// Keys i0..i0+n-1 (n <= 16) of a segment widened into wide[i * DIM ..] (with `nk` / `nv`, the next block's rows of
// this head or null, each key's step also asks for one row of each: spread over the segment, the requests do not
// queue up behind each other as a burst of a whole block's lines at once did).
template <int DIM, typename KV, int LOC>
__attribute__((always_inline)) static inline void widen_keys16(const KV* __restrict__ kb, int64_t i0, int n,
                                                               int64_t stride, float* __restrict__ wide, const KV* nk,
                                                               const KV* nv, int64_t ahead) {
  constexpr int C = DIM / 16;
  for (int i = 0; i < n; ++i) {
    if (nk != nullptr && i0 + i < ahead) prefetch_kv_row<DIM, LOC>(nk + (i0 + i) * stride, nv + (i0 + i) * stride);
    __m512 kr[C];
    load_row<DIM>(kb + (i0 + i) * stride, kr);
    for (int c = 0; c < C; ++c) _mm512_store_ps(wide + i * DIM + 16 * c, kr[c]);
  }
}

// scores[g * block_size + i] = scale * (q_g . k_i) for the count keys of one segment and the G query heads sharing
// them, 16 keys at a time, each widened once and scored for every head (for one head too: an item per query head
// gives the bits of an item per KV head).
template <int DIM, int GROUP, typename KV, int LOC>
static inline void segment_scores(const float* __restrict__ qh, const KV* __restrict__ kb, int64_t count,
                                  int64_t stride, float scale, float* __restrict__ scores, int64_t block_size,
                                  const KV* nk, const KV* nv, int64_t ahead) {
  alignas(64) float wide[16 * DIM];
  for (int64_t i0 = 0; i0 < count; i0 += 16) {
    const int n = (int)std::min<int64_t>(16, count - i0);
    widen_keys16<DIM, KV, LOC>(kb, i0, n, stride, wide, nk, nv, ahead);
    for (int g = 0; g < GROUP; ++g) head_scores16<DIM>(qh + g * DIM, wide, n, scale, scores + g * block_size + i0);
  }
  for (int64_t i = count; i < ahead; ++i)  // a short segment (a window's first): the rest of the next block
    prefetch_kv_row<DIM, LOC>(nk + i * stride, nv + i * stride);
}

// The columns of the value pass per sweep over a segment's keys: all DIM / 16 pieces when the G heads'
// accumulators, one value row and the G weights fit in the 32 registers with room to spare (SmolLM2: 3 x 4 + 4 + 3),
// else the widest power of two that does (Gemma 3, 4 heads x 256 dims: 4 pieces a sweep, four sweeps). Each lane's
// arithmetic is the same either way: rescaled once per segment, then one FMA per key in key order.
template <int GROUP, int C>
constexpr int value_pieces() {
  int n = C;
  while (n > 1 && GROUP * n + n + GROUP > 30) n /= 2;
  return n;
}

// The keys first..len-1 of one (query, KV head) item for its G query heads, segment by segment (a segment: the keys
// of one block): the scores, the online-softmax step (softmax_segment16: the max, the rescale of what came before,
// exp, sum), then the accumulators rescaled and each value added key by key. Where they fit (value_pieces), the
// accumulators stay in registers from the first segment to the last; else they live in `acc` between sweeps.
// acc / row_max / row_sum: the running state at the start (zero, -inf, 0), and acc at the end; scores:
// GROUP * block_size floats. The next block's rows of this head are asked for while this
// one is computed (AHEAD blocks ahead, into the cache level LOC: see attention.cpp); during the last block, the
// first rows of the item that comes next on this thread (fk / fv / frows), which otherwise started cold.
template <int DIM, int GROUP, typename KV, int AHEAD, int LOC>
__attribute__((noinline)) static void attend_avx512(
    const float* __restrict__ qh, const KV* __restrict__ kp, const KV* __restrict__ vp,
    const int64_t* __restrict__ table, int64_t first, int64_t len, int64_t block_size, int64_t kv_heads, int64_t h,
    float scale, float* __restrict__ scores, float* __restrict__ acc, float* __restrict__ row_max,
    float* __restrict__ row_sum, const KV* fk, const KV* fv, int64_t frows) {
  constexpr int C = DIM / 16, P = value_pieces<GROUP, C>();
  constexpr bool in_registers = P == C;  // else the accumulators live in `acc` between sweeps
  const int64_t stride = kv_heads * DIM;
  __m512 av[GROUP][in_registers ? C : 1];
  if constexpr (in_registers)
    for (int g = 0; g < GROUP; ++g)
      for (int c = 0; c < C; ++c) av[g][c] = _mm512_loadu_ps(acc + g * DIM + 16 * c);
  for (int64_t start = first; start < len;) {
    const int64_t block = start / block_size, stop = std::min(len, (block + 1) * block_size), count = stop - start;
    const int64_t row0 = (table[block] * block_size + start - block * block_size) * kv_heads + h;
    const int64_t later = block + AHEAD;
    const KV *nk = fk, *nv = fv;  // past the last block: the next item's first (or nothing)
    int64_t ahead = later * block_size < len + block_size ? frows : 0;
    if (later * block_size < len) {  // a later block sits elsewhere in the pool
      const int64_t next = table[later] * block_size * kv_heads + h;
      nk = kp + next * DIM;
      nv = vp + next * DIM;
      ahead = std::min(block_size, len - later * block_size);
    }
    segment_scores<DIM, GROUP, KV, LOC>(qh, kp + row0 * DIM, count, stride, scale, scores, block_size, nk, nv, ahead);
    float rescale[GROUP];  // head by head (softmax_heads16<GROUP> here: 0.97x, the accumulators held in registers
    // across the segments leave it too few)
    for (int g = 0; g < GROUP; ++g)
      rescale[g] = softmax_segment16(scores + g * block_size, count, row_max[g], row_sum[g]);
    const KV* vb = vp + row0 * DIM;
    if constexpr (in_registers) {
      for (int g = 0; g < GROUP; ++g)
        for (int c = 0; c < C; ++c) av[g][c] = _mm512_mul_ps(av[g][c], _mm512_set1_ps(rescale[g]));
      for (int64_t i = 0; i < count; ++i) {
        __m512 vr[C];
        load_row<DIM>(vb + i * stride, vr);
        for (int g = 0; g < GROUP; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * block_size + i]);
          for (int c = 0; c < C; ++c) av[g][c] = _mm512_fmadd_ps(p, vr[c], av[g][c]);
        }
      }
    } else {
      for (int c0 = 0; c0 < C; c0 += P) {  // P pieces of every head's accumulator, swept over the segment's keys
        __m512 a[GROUP][P];
        for (int g = 0; g < GROUP; ++g)
          for (int c = 0; c < P; ++c)
            a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * DIM + 16 * (c0 + c)), _mm512_set1_ps(rescale[g]));
        for (int64_t i = 0; i < count; ++i) {
          __m512 vr[P];
          load_pieces<P>(vb + i * stride + 16 * c0, vr);
          for (int g = 0; g < GROUP; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * block_size + i]);
            for (int c = 0; c < P; ++c) a[g][c] = _mm512_fmadd_ps(p, vr[c], a[g][c]);
          }
        }
        for (int g = 0; g < GROUP; ++g)
          for (int c = 0; c < P; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * (c0 + c), a[g][c]);
      }
    }
    start = stop;
  }
  if constexpr (in_registers)
    for (int g = 0; g < GROUP; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * c, av[g][c]);
}
#endif
