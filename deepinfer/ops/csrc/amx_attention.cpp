// Prompt rows' attention on AMX tiles: queries and probabilities rounded to bfloat16, the bfloat16 cache read as it
// is, products summed in float32 by TDPBF16PS (the tile counterpart of amx_linear.cpp for the linear layers).
//
// A query at position p attends to keys lo..p (lo = max(0, p - window + 1) with a window, else 0) in blocks of 32
// keys fixed by position (block j: keys 32j..32j+31), in block order, with an online softmax: per block the scores
// s = (q . k) * scale of its visible keys, m' = max(m, max s), the probabilities exp(s - m') rounded to bfloat16, the
// running sum l' = l * exp(m - m') + their sum (16 partial sums, added once at the end), the accumulator
// o' = o * exp(m - m') (skipped where every row's factor is 1) with P V added onto it by TDPBF16PS. A row of a tile
// depends on its own query only: its invisible keys get probability exactly 0, a block none of whose keys it sees
// leaves it untouched, and a factor of 1 leaves it unchanged. So a query's output has the same bits whichever chunk,
// tile and thread computes it, alone or beside others: chunked prefill and prefix-cache hits keep their bits.
//
// Work in two passes: prepare (per run of one sequence, KV head and key block: the block's keys as the tile's second
// source of Q K^T, its values as that of P V; keys outside the run's range are zeros) and items (per run, query
// head and 16 consecutive queries). The caller configures the tiles (amx_configure) on each thread between them.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "kernels.h"
#include "ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "vexp.h"

namespace {

constexpr int64_t kKeys = 32;         // keys per block
constexpr int64_t kTile = 512;        // uint16 values in one 16 x 64-byte tile
inline int64_t key_tiles(int64_t D) { return D / 32 * 2; }  // Q K^T second sources per block: D/32 chunks x 2 halves
inline int64_t value_tiles(int64_t D) { return D / 16; }    // P V second sources per block: one per 16 dims

inline int64_t first_key(const AmxAttention& a, int64_t p) {
  return a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
}

}  // namespace

AmxAttention amx_attention_plan(const float* q, int64_t q_stride, const torch::Tensor& k_cache,
                                const torch::Tensor& v_cache, int64_t heads, std::vector<AmxAttnRun> runs,
                                int64_t block_size, double scale, int64_t window, float* out, int64_t out_stride) {
  AmxAttention a;
  a.q = q, a.q_stride = q_stride, a.out = out, a.out_stride = out_stride;
  a.k_cache = static_cast<const uint16_t*>(k_cache.data_ptr());
  a.v_cache = static_cast<const uint16_t*>(v_cache.data_ptr());
  a.heads = heads, a.kv_heads = k_cache.size(1), a.dim = k_cache.size(2);
  a.block_size = block_size, a.scale = static_cast<float>(scale), a.window = window;
  const int64_t D = a.dim, per_block = (key_tiles(D) + value_tiles(D)) * kTile;
  int64_t room = 0;
  for (AmxAttnRun& r : runs) {
    r.kb0 = first_key(a, r.pos0) / kKeys;
    r.nkb = (r.pos0 + r.count - 1) / kKeys - r.kb0 + 1;
    r.prep0 = a.prep_items, r.item0 = a.items, r.offset = room;
    a.prep_items += a.kv_heads * r.nkb;
    a.items += heads * ((r.count + 15) / 16);
    room += a.kv_heads * r.nkb * per_block;
  }
  a.runs = std::move(runs);
  a.room = room;
  return a;
}

// Run r's KV head h, block j: keys as [D/32][2][16 rows][16 keys][2] (row i: dims 32c + 2i, 32c + 2i + 1 of each key
// of the half), values as [D/16][16 rows][16 dims][2] (row i: keys 2i, 2i + 1 of each dim).
void amx_attention_prepare(const AmxAttention& a, int64_t begin, int64_t end) {
  const int64_t D = a.dim, kt = key_tiles(D), per_block = (kt + value_tiles(D)) * kTile;
  for (int64_t i = begin; i < end; ++i) {
    const AmxAttnRun* r = &a.runs[0];
    while (r + 1 < a.runs.data() + a.runs.size() && (r + 1)->prep0 <= i) ++r;
    const int64_t local = i - r->prep0, h = local / r->nkb, j = local % r->nkb, kb = r->kb0 + j;
    uint16_t* keys = a.tiles + r->offset + (h * r->nkb + j) * per_block;
    uint16_t* values = keys + kt * kTile;
    const int64_t lo = first_key(a, r->pos0), hi = r->pos0 + r->count - 1;  // the keys any query of the run sees
    for (int64_t l = 0; l < kKeys; ++l) {
      const int64_t p = kb * kKeys + l;
      uint32_t* kd = reinterpret_cast<uint32_t*>(keys) + (l / 16) * 256 + l % 16;
      uint16_t* vd = values + (l / 2) * 32 + l % 2;
      if (p < lo || p > hi) {
        for (int64_t c = 0; c < D / 2; ++c) kd[(c / 16) * 512 + (c % 16) * 16] = 0;
        for (int64_t d = 0; d < D; ++d) vd[(d / 16) * kTile + (d % 16) * 2] = 0;
        continue;
      }
      const int64_t slot = r->table[p / a.block_size] * a.block_size + p % a.block_size;
      const uint32_t* ks = reinterpret_cast<const uint32_t*>(a.k_cache + (slot * a.kv_heads + h) * D);
      const uint16_t* vs = a.v_cache + (slot * a.kv_heads + h) * D;
      for (int64_t c = 0; c < D / 2; ++c) kd[(c / 16) * 512 + (c % 16) * 16] = ks[c];
      for (int64_t d = 0; d < D; ++d) vd[(d / 16) * kTile + (d % 16) * 2] = vs[d];
    }
  }
}

namespace {

// The visible keys of query p in block kb, as bits of its 32 keys.
inline __mmask32 visible_keys(int64_t lo, int64_t p, int64_t kb) {
  const int64_t from = std::max(lo, kb * kKeys) - kb * kKeys, to = std::min(p, kb * kKeys + kKeys - 1) - kb * kKeys;
  if (from > to) return 0;
  const uint32_t upto = to >= 31 ? 0xFFFFFFFFu : (1u << (to + 1)) - 1;
  return (__mmask32)(upto & ~((1u << from) - 1));
}

// One block's online-softmax step for the 16 rows of a tile, from their 16 x 32 scores: each row's visible scores
// scaled (the rest -inf), its running max moved on (row_max, 16 lanes), the rescale factors exp(old - new) (one
// vector exp; 1 for a row that sees no key here, 0 for one that saw none before), the probabilities exp(s - max)
// rounded to bfloat16 (zeros where invisible) into probs, and each row's running sum, kept as 16 partial sums
// (sums[i]: lane j sums keys j and j + 16), taking the rounded probabilities.
inline __m512 softmax_block(float* scores, const __mmask32* visible, float scale, float* row_max, float* sums,
                            uint16_t* probs) {
  alignas(64) float new_max[16];
  const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  for (int i = 0; i < 16; ++i) {
    new_max[i] = row_max[i];
    if (visible[i] == 0) continue;
    float* s = scores + i * kKeys;
    const __mmask16 m0 = (__mmask16)(visible[i] & 0xFFFF), m1 = (__mmask16)(visible[i] >> 16);
    const __m512 s0 = _mm512_mask_mul_ps(ninf, m0, _mm512_loadu_ps(s), sc);
    const __m512 s1 = _mm512_mask_mul_ps(ninf, m1, _mm512_loadu_ps(s + 16), sc);
    _mm512_storeu_ps(s, s0);
    _mm512_storeu_ps(s + 16, s1);
    new_max[i] = std::max(row_max[i], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  }
  const __m512 old = _mm512_loadu_ps(row_max), now = _mm512_load_ps(new_max);
  const __mmask16 seen = _mm512_cmp_ps_mask(old, ninf, _CMP_NEQ_OQ);  // rows that saw a key before
  const __m512 rescale = _mm512_maskz_mov_ps(seen, exp_lanes(_mm512_sub_ps(old, now)));
  _mm512_storeu_ps(row_max, now);
  alignas(64) float factor[16];
  _mm512_store_ps(factor, rescale);
  for (int i = 0; i < 16; ++i) {
    if (visible[i] == 0) {
      _mm512_storeu_si512(probs + i * kKeys, _mm512_setzero_si512());
      continue;
    }
    const float* s = scores + i * kKeys;
    const __mmask16 m0 = (__mmask16)(visible[i] & 0xFFFF), m1 = (__mmask16)(visible[i] >> 16);
    const __m512 shift = _mm512_set1_ps(new_max[i]);
    const __m512 p0 = _mm512_maskz_mov_ps(m0, exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(s), shift)));
    const __m512 p1 = _mm512_maskz_mov_ps(m1, exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(s + 16), shift)));
    const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_storeu_si512(probs + i * kKeys, pb);
    // the rounded probabilities (what P V multiplies), widened back exactly
    const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pb)), 16));
    const __m512 r1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pb, 1)),
                                                            16));
    _mm512_storeu_ps(sums + i * 16, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(sums + i * 16),
                                                                _mm512_set1_ps(factor[i])),
                                                  _mm512_add_ps(r0, r1)));
  }
  return rescale;
}

}  // namespace

// Tiles: 0, 1 the scores of a block's two halves; 2 a query chunk; 3 a key tile; 4 the probabilities; 5 a value
// tile; 6 16 dims of the accumulators (all 16 rows x 64 bytes, as amx_configure sets them).
void amx_attention_items(const AmxAttention& a, int64_t begin, int64_t end) {
  const int64_t D = a.dim, kt = key_tiles(D), per_block = (kt + value_tiles(D)) * kTile, G = a.heads / a.kv_heads;
  alignas(64) uint16_t qb[16 * 256];
  alignas(64) float acc[16 * 256];
  alignas(64) float scores[16 * kKeys];
  alignas(64) uint16_t probs[16 * kKeys];
  alignas(64) float row_max[16], sums[16 * 16], rescale[16];
  __mmask32 visible[16];
  for (int64_t item = begin; item < end; ++item) {
    const AmxAttnRun* r = &a.runs[0];
    while (r + 1 < a.runs.data() + a.runs.size() && (r + 1)->item0 <= item) ++r;
    const int64_t tiles_per_head = (r->count + 15) / 16, local = item - r->item0;
    const int64_t hq = local / tiles_per_head, t0 = local % tiles_per_head * 16, h = hq / G;
    const int64_t rows = std::min<int64_t>(16, r->count - t0);
    for (int64_t i = 0; i < 16; ++i) {  // the queries rounded to bfloat16; rows past the run: zeros
      uint16_t* dst = qb + i * D;
      if (i >= rows) {
        std::memset(dst, 0, D * sizeof(uint16_t));
        continue;
      }
      const float* src = a.q + (r->row0 + t0 + i) * a.q_stride + hq * D;
      for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                                 _mm512_loadu_ps(src + d)));
    }
    std::memset(acc, 0, 16 * D * sizeof(float));
    std::memset(sums, 0, sizeof(sums));
    for (int i = 0; i < 16; ++i) row_max[i] = -INFINITY;
    const int64_t p_first = r->pos0 + t0, p_last = p_first + rows - 1;
    const int64_t kb_lo = first_key(a, p_first) / kKeys, kb_hi = p_last / kKeys;
    for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
      const uint16_t* keys = a.tiles + r->offset + (h * r->nkb + (kb - r->kb0)) * per_block;
      const uint16_t* values = keys + kt * kTile;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(2, qb + c * 32, D * 2);
        _tile_loadd(3, keys + (2 * c) * kTile, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, keys + (2 * c + 1) * kTile, 64);
        _tile_dpbf16ps(1, 2, 3);
      }
      _tile_stored(0, scores, kKeys * 4);
      _tile_stored(1, scores + 16, kKeys * 4);
      for (int64_t i = 0; i < 16; ++i)  // keys max(lo, 32 kb) .. min(p, 32 kb + 31) of this block
        visible[i] = i < rows ? visible_keys(first_key(a, p_first + i), p_first + i, kb) : 0;
      _mm512_store_ps(rescale, softmax_block(scores, visible, a.scale, row_max, sums, probs));
      bool scaled = false;  // any row's factor other than 1 (a row's bits do not depend on whether: x * 1 == x)
      for (int64_t i = 0; i < rows; ++i) scaled = scaled || rescale[i] != 1.f;
      if (scaled)
        for (int64_t i = 0; i < rows; ++i) {
          const __m512 f = _mm512_set1_ps(rescale[i]);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(acc + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + d), f));
        }
      _tile_loadd(4, probs, 64);
      for (int64_t c = 0; c < D / 16; ++c) {  // acc += P V, 16 dims at a time, summed on the tiles
        _tile_loadd(6, acc + c * 16, D * 4);
        _tile_loadd(5, values + c * kTile, 64);
        _tile_dpbf16ps(6, 4, 5);
        _tile_stored(6, acc + c * 16, D * 4);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* o = a.out + (r->row0 + t0 + i) * a.out_stride + hq * D;
      const __m512 inv = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_loadu_ps(sums + i * 16)));
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_div_ps(_mm512_loadu_ps(acc + i * D + d), inv));
    }
  }
}

bool amx_attention_built() { return true; }

#else  // built without AMX-BF16: the plan exists (so the stack compiles), nothing runs it

AmxAttention amx_attention_plan(const float*, int64_t, const torch::Tensor&, const torch::Tensor&, int64_t,
                                std::vector<AmxAttnRun>, int64_t, double, int64_t, float*, int64_t) {
  throw std::runtime_error("amx_attention: this build has no AMX-BF16 (the CPU it was built for lacks it)");
}
void amx_attention_prepare(const AmxAttention&, int64_t, int64_t) {}
void amx_attention_items(const AmxAttention&, int64_t, int64_t) {}
bool amx_attention_built() { return false; }

#endif

// q [T, H, D] float32 at positions first_position.., one block table; the cache bfloat16 [slots, Hkv, D].
torch::Tensor amx_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                            int64_t first_position, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(amx_attention_built() && amx_ready(), "amx_attention: needs a build with AMX-BF16 and AMX tile state");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be contiguous float32 "
              "[T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16 && v_cache.scalar_type() == torch::kBFloat16 &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "amx_attention: contiguous bfloat16 K and V caches of one shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && (D == 64 || D == 128 || D == 256) && H % Hkv == 0,
              "amx_attention: head dims 64, 128 or 256, query heads a multiple of KV heads");
  table = table.contiguous().to(torch::kLong);
  TORCH_CHECK(first_position >= 0 && block_size > 0 &&
              (first_position + T + block_size - 1) / block_size <= table.numel(), "amx_attention: the table does "
              "not cover the positions");
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < (first_position + T + block_size - 1) / block_size; ++b)
    TORCH_CHECK(tp[b] >= 0 && (tp[b] + 1) * block_size <= k_cache.size(0), "amx_attention: block out of range");
  auto out = torch::empty_like(q);
  if (T == 0) return out;
  AmxAttention a = amx_attention_plan(q.data_ptr<float>(), H * D, k_cache, v_cache, H,
                                            {AmxAttnRun{0, T, first_position, tp}}, block_size, scale, window,
                                            out.data_ptr<float>(), H * D);
  std::vector<uint16_t> room(a.room + 32);
  a.tiles = amx_aligned64(room.data());
  at::parallel_for(0, a.prep_items, 1, [&](int64_t begin, int64_t end) { amx_attention_prepare(a, begin, end); });
  at::parallel_for(0, a.items, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    amx_attention_items(a, begin, end);
    amx_release();
  });
  return out;
}
