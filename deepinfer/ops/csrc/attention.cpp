// Paged attention kernels for the CPU: one pass over each sequence's cached K/V, straight from its blocks.
//
// `paged_decode` reads each cached key and value once: per (query, KV head) it scores the G query heads that share
// the KV head against one block segment of keys, rescales a running max / sum / weighted value sum (online softmax,
// one rescale per segment), and writes acc / sum; sliding windows start at max(0, len - W). `paged_prefill` runs the
// same per-query computation for each token of a prefill chunk (one compiled copy of the segment step, no FMA
// contraction), so a token gets the same bits from either path: the batch-invariant mode's attention. With AVX-512 or
// AVX2, runs of consecutive positions of one sequence become query tiles (attention_tiles.h), each query's
// arithmetic unchanged. Queries in float32; the cache in float32, bfloat16 or float8 e4m3fn (each value widened to
// float32 as it is read).
#include "aten.h"
#include <algorithm>
#include <cmath>
#include <vector>
#include <type_traits>

#include "kernels.h"
#include "prefetch_level.h"
#include "kv_fp8.h"
#include "vexp.h"
#include "attention_avx2.h"  // defines DI_ATTN_AVX2 and block_step_avx2 when it applies
#include "attention_avx512.h"  // attend_avx512 when the CPU has AVX-512

// One cached row of DIM values as float32: a float32 row is read in place; a bfloat16 row (the top half of each
// float32's bits) is widened into `buffer`.
template <int DIM>
static inline const float* as_float(const float* row, float*) { return row; }
template <int DIM>
static inline const float* as_float(const uint16_t* row, float* __restrict__ buffer) {
  uint32_t* __restrict__ bits = reinterpret_cast<uint32_t*>(buffer);
#pragma omp simd
  for (int d = 0; d < DIM; ++d) bits[d] = static_cast<uint32_t>(row[d]) << 16;
  return buffer;
}
template <int DIM>
static inline const float* as_float(const uint8_t* row, float* __restrict__ buffer) {
#pragma omp simd
  for (int d = 0; d < DIM; ++d) buffer[d] = fp8_value(row[d]);
  return buffer;
}

// The online-softmax update of one head for one segment: scores sg[0..count) become exp(score - new max) in place,
// the running max and sum move on; returns the factor the head's accumulated values must be rescaled by.
static inline float softmax_segment(float* __restrict__ sg, int64_t count, float& row_max, float& row_sum) {
  float block_max = -INFINITY;
  for (int64_t i = 0; i < count; ++i) block_max = std::max(block_max, sg[i]);
  const float new_max = std::max(row_max, block_max);
  const float rescale = std::exp(row_max - new_max);
  row_max = new_max;
  exp_shifted(sg, count, new_max);
  float sum = 0.f;
  for (int64_t i = 0; i < count; ++i) sum += sg[i];
  row_sum = row_sum * rescale + sum;
  return rescale;
}


// One segment (count <= block_size consecutive keys of one block) for the G query heads of one (query, KV head):
// the online-softmax update (with AVX-512, groups of 1, 2, 3, 4 and 8 go through attend_avx512 instead). noinline:
// decode and prefill run this very machine code in the same order of segments, so a token's result does not depend
// on which path computed it (batch-invariant mode relies on it).
template <int DIM, int GROUP, typename KV>  // GROUP 0: the group size is only known at run time (`group`)
__attribute__((noinline)) static void block_step(const float* __restrict__ qh, const KV* __restrict__ kb,
                                                 const KV* __restrict__ vb, int64_t count, int64_t stride,
                                                 int64_t group, int64_t block_size, float scale,
                                                 float* __restrict__ scores, float* __restrict__ acc,
                                                 float* __restrict__ row_max, float* __restrict__ row_sum) {
#if defined(DI_ATTN_AVX2)
  if constexpr (GROUP > 0) {
    block_step_avx2<DIM, GROUP, KV>(qh, kb, vb, count, stride, block_size, scale, scores, acc, row_max, row_sum);
    return;
  }
#endif
  const int64_t G = GROUP > 0 ? GROUP : group;
  alignas(64) float wide[DIM];  // a bfloat16 row widened once, then read by all G query heads
  for (int64_t i = 0; i < count; ++i) {  // each key read once, scored for the G query heads sharing it
    const float* __restrict__ k = as_float<DIM>(kb + i * stride, wide);
    for (int64_t g = 0; g < G; ++g) {
      const float* __restrict__ qg = qh + g * DIM;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < DIM; ++d) dot += qg[d] * k[d];
      scores[g * block_size + i] = dot * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // one rescale per segment
    const float rescale = softmax_segment(scores + g * block_size, count, row_max[g], row_sum[g]);
    float* __restrict__ a = acc + g * DIM;
#pragma omp simd
    for (int d = 0; d < DIM; ++d) a[d] *= rescale;
  }
  for (int64_t i = 0; i < count; ++i) {  // each value read once
    const float* __restrict__ v = as_float<DIM>(vb + i * stride, wide);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * block_size + i];
      float* __restrict__ a = acc + g * DIM;
#pragma omp simd
      for (int d = 0; d < DIM; ++d) a[d] += p * v[d];
    }
  }
}


// Prefetch: the rows of the block DI_ATTN_AHEAD blocks ahead, into L2 (locality 2: prefetcht1) or L1 (3). Asked for
// all at once when a block starts, a block's 64 lines queued behind the L1's few miss buffers, and L2 was better: 1.3-
// 1.45x over L1 on the slower EPYC (benchmarks/attention_prefetch.py). The AVX-512 loop (attend_avx512) asks for one
// row of K and of V with each key it scores, spread over the block, into the level the machine does best with
// (a.prefetch: prefetch_level.h; L1 on the Zen 5 EPYC, L2 on the Zen 4); two or three blocks ahead were slower
// than one.
#ifndef DI_ATTN_AHEAD
#define DI_ATTN_AHEAD 1
#endif
#ifndef DI_ATTN_BLOCK_LOC
#define DI_ATTN_BLOCK_LOC 2  // the block-at-once requests of the loop below (without AVX-512)
#endif
// One (query, KV head) item: G query heads against the keys first..len-1 of one sequence, segment by segment.
// fk / fv / frows: the first block rows of the item this thread runs next (or null), asked for during the last block
// (AVX-512 loop only).
template <int DIM, typename KV>
static void attend(const float* __restrict__ qh, const KV* __restrict__ kp, const KV* __restrict__ vp,
                   const int64_t* __restrict__ table, int64_t first, int64_t len, int64_t block_size,
                   int64_t kv_heads, int64_t h, int64_t group, float scale, float* __restrict__ out,
                   float* __restrict__ scores, float* __restrict__ acc, float* __restrict__ row_max,
                   float* __restrict__ row_sum, const KV* fk, const KV* fv, int64_t frows, int loc) {
  const int64_t stride = kv_heads * DIM;  // floats between consecutive tokens of one head
  for (int64_t g = 0; g < group; ++g) { row_max[g] = -INFINITY; row_sum[g] = 0.f; }
  for (int64_t i = 0; i < group * DIM; ++i) acc[i] = 0.f;
  bool done = false;  // the item computed by the AVX-512 loop
#if defined(__AVX512F__)
  auto avx512 = [&](auto grp) {  // the group as a constant: its loops unroll and the accumulators stay in registers
    auto run = [&](auto level) {  // the prefetch level as a constant too
      attend_avx512<DIM, decltype(grp)::value, KV, DI_ATTN_AHEAD, decltype(level)::value>(
          qh, kp, vp, table, first, len, block_size, kv_heads, h, scale, scores, acc, row_max, row_sum, fk, fv, frows);
    };
    if (loc == 3) run(std::integral_constant<int, 3>{});
    else run(std::integral_constant<int, 2>{});
    done = true;
  };
  switch (group) {
    case 1: avx512(std::integral_constant<int, 1>{}); break;
    case 2: avx512(std::integral_constant<int, 2>{}); break;
    case 3: avx512(std::integral_constant<int, 3>{}); break;
    case 4: avx512(std::integral_constant<int, 4>{}); break;
    case 8: avx512(std::integral_constant<int, 8>{}); break;
    default: break;
  }
#endif
  for (int64_t start = done ? len : first; start < len;) {
    const int64_t block = start / block_size, stop = std::min(len, (block + 1) * block_size);
    const int64_t row0 = (table[block] * block_size + start - block * block_size) * kv_heads + h;
    const KV* kb = kp + row0 * DIM;
    const KV* vb = vp + row0 * DIM;
    const int64_t n = stop - start;
    const int64_t later = block + DI_ATTN_AHEAD;
    if (later * block_size < len) {  // a later block sits elsewhere in the pool: ask for its rows of this head now
      // (no value changes)
      const int64_t next = table[later] * block_size * kv_heads + h;
      const int64_t ahead = std::min(block_size, len - later * block_size);
      for (int64_t i = 0; i < ahead; ++i)
        prefetch_kv_row<DIM, DI_ATTN_BLOCK_LOC>(kp + (next + i * kv_heads) * DIM, vp + (next + i * kv_heads) * DIM);
    }
#if defined(__AVX512F__)
    block_step<DIM, 0, KV>(qh, kb, vb, n, stride, group, block_size, scale, scores, acc, row_max, row_sum);
#else
    switch (group) {  // the group as a constant: its loops unroll and the accumulators stay in registers
      case 1: block_step<DIM, 1, KV>(qh, kb, vb, n, stride, group, block_size, scale, scores, acc, row_max, row_sum); break;
      case 2: block_step<DIM, 2, KV>(qh, kb, vb, n, stride, group, block_size, scale, scores, acc, row_max, row_sum); break;
      case 3: block_step<DIM, 3, KV>(qh, kb, vb, n, stride, group, block_size, scale, scores, acc, row_max, row_sum); break;
      case 4: block_step<DIM, 4, KV>(qh, kb, vb, n, stride, group, block_size, scale, scores, acc, row_max, row_sum); break;
      case 8: block_step<DIM, 8, KV>(qh, kb, vb, n, stride, group, block_size, scale, scores, acc, row_max, row_sum); break;
      default: block_step<DIM, 0, KV>(qh, kb, vb, n, stride, group, block_size, scale, scores, acc, row_max, row_sum);
    }
#endif
    start = stop;
  }
  for (int64_t g = 0; g < group; ++g)
    for (int d = 0; d < DIM; ++d) out[g * DIM + d] = acc[g * DIM + d] / row_sum[g];
}

// Items begin..end-1 of a decode batch: item i is the query heads [i * Q / items, (i + 1) * Q / items) of the
// Q = rows * heads (row n's heads are n * heads ..), run piece by piece, a piece being the heads of the range that
// share one KV head. Row n is a query at position lens[n] - 1.
// Slots, not items, are what callers split among threads in contiguous ranges: slot 2j is item j and slot 2j + 1 is
// item items - 1 - j, so each range holds short and long rows alike (a prompt's queries grow by one key each, decode
// rows come longest context first); an item's arithmetic does not depend on where it runs.
static inline int64_t item_at(int64_t slot, int64_t items) {
  return slot % 2 == 0 ? slot / 2 : items - 1 - slot / 2;
}

// Query heads head..head+count-1 of row n, sharing KV head h, over keys first..len-1: attend for the head dimension
// (fk / fv / frows: the rows the piece's last block asks for, or none).
template <typename KV>
static inline void attend_piece(const DecodeAttention& a, int64_t head, int64_t n, int64_t h, int64_t count,
                                int64_t first, int64_t len, float* scores, float* acc, float* row_max, float* row_sum,
                                const KV* fk, const KV* fv, int64_t frows) {
  auto run = [&](auto fn) {
    fn(a.q + head * a.dim, static_cast<const KV*>(a.k_cache), static_cast<const KV*>(a.v_cache),
       a.tables + n * a.width, first, len, a.block_size, a.kv_heads, h, count, a.scale, a.out + head * a.dim, scores,
       acc, row_max, row_sum, fk, fv, frows, a.prefetch);
  };
  if (a.dim == 64) run(attend<64, KV>);
  else if (a.dim == 128) run(attend<128, KV>);
  else run(attend<256, KV>);
}

template <typename KV>
static void items_of(const DecodeAttention& a, int64_t begin, int64_t end, float* scratch) {
  const KV* kp = static_cast<const KV*>(a.k_cache);
  const KV* vp = static_cast<const KV*>(a.v_cache);
  const int64_t heads = a.heads, dim = a.dim, group = heads / a.kv_heads, total = a.rows * heads;
  float* scores = scratch;
  float* acc = scores + a.per * a.block_size;
  float* row_max = acc + a.per * dim;
  float* row_sum = row_max + a.per;
  struct Piece {  // the heads head..head+count-1 of row n, sharing KV head h, over keys first..len-1
    int64_t slot, head, n, h, count, first, len;
  };
  auto piece = [&](int64_t slot, int64_t head) {
    const int64_t item = item_at(slot, a.items), stop = (item + 1) * total / a.items;
    if (head < 0) head = item * total / a.items;
    const int64_t n = head / heads, h = (head % heads) / group, len = a.lens[n];
    return Piece{slot, head, n, h, std::min(stop, n * heads + (h + 1) * group) - head,
                 a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0, len};
  };
  auto next = [&](const Piece& p) {  // the piece this thread runs after p; slot == end: none
    const int64_t item = item_at(p.slot, a.items);
    if (p.head + p.count < (item + 1) * total / a.items) return piece(p.slot, p.head + p.count);
    return p.slot + 1 < end ? piece(p.slot + 1, -1) : Piece{end, 0, 0, 0, 0, 0, 0};
  };
  if (begin >= end) return;
  for (Piece p = piece(begin, -1); p.slot < end;) {
    const Piece f = next(p);
    // the first block rows of the piece that follows, for the last block of this one to ask for
    const KV *fk = nullptr, *fv = nullptr;
    int64_t frows = 0;
    if (f.slot < end && f.first < f.len) {
      const int64_t b = f.first / a.block_size, off = f.first - b * a.block_size;
      const int64_t row0 = (a.tables[f.n * a.width + b] * a.block_size + off) * a.kv_heads + f.h;
      fk = kp + row0 * dim;
      fv = vp + row0 * dim;
      frows = std::min(a.block_size - off, f.len - f.first);
    }
    attend_piece<KV>(a, p.head, p.n, p.h, p.count, p.first, p.len, scores, acc, row_max, row_sum, fk, fv, frows);
    p = f;
  }
}

#include "attention_tiles.h"  // query tiles (AVX-512, AVX2): next_position, tiles_of

DecodeAttention decode_attention(const float* q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 int64_t rows, int64_t heads, const int64_t* tables, int64_t width,
                                 const int64_t* lens, int64_t block_size, double scale, int64_t window, float* out,
                                 int threads, int prefetch) {
  TORCH_CHECK(prefetch == 0 || prefetch == 2 || prefetch == 3,
              "paged attention kernel: prefetch is 0 (the machine's choice), 2 (L2) or 3 (L1), got ", prefetch);
  const int64_t kv_heads = k_cache.size(1), dim = k_cache.size(2), group = heads / kv_heads;
  // Few (row, KV head) items for the threads (one user: 3 for SmolLM2 on 2 threads): one item per thread, the
  // query heads split evenly, each KV head read by every thread that has some of its heads (SmolLM2: KV heads
  // {0, 1} for heads 0-3, {1, 2} for heads 4-8), rather than a KV head per item (3 items on 2 threads) or a query
  // head per item (each KV head read 3 times). A head's arithmetic is the same whatever piece it runs in (no
  // operation mixes heads), so the bits are too, as long as every piece size runs the code one head runs: with
  // AVX-512 and AVX2 the sizes with their own compiled copy are 1, 2, 3, 4 and 8, so the split is for groups up
  // to 4; larger groups go one head per item when rows are few.
#if defined(__AVX512F__) || defined(DI_ATTN_AVX2)
  const bool same_code = group == 1 || group == 2 || group == 3 || group == 4 || group == 8;
  const bool any_piece = group <= 4;
#else
  const bool same_code = true, any_piece = true;
#endif
  const int64_t total = rows * heads, pairs = rows * kv_heads;
  const bool few = pairs < 2 * threads && pairs % threads != 0;
  int64_t per = group, items = pairs;  // a row's G heads of one KV head per item
  if (same_code && few && any_piece) {
    items = std::min<int64_t>(threads, total);  // the heads split evenly, one item per thread
  } else if (!same_code || few) {
    per = 1;  // one query head per item
    items = total;
  }
  std::vector<std::pair<int64_t, int64_t>> tiles;
#if defined(__AVX512F__) || defined(DI_ATTN_AVX2)
  if (per == group && items == pairs && group <= 4) {  // runs of DI_ATTN_TILE rows of one sequence become tiles
    bool any = false;
    for (int64_t n = 0; n < rows;) {
      int64_t m = 1;
      while (m < DI_ATTN_TILE && n + m < rows && next_position(tables, width, lens, block_size, n + m - 1)) ++m;
      if (m < DI_ATTN_TILE) m = 1;
      tiles.emplace_back(n, m);
      any = any || m > 1;
      n += m;
    }
    if (any) {
      items = static_cast<int64_t>(tiles.size()) * kv_heads;
      per = DI_ATTN_TILE * group;
    } else {
      tiles.clear();
    }
  }
#endif
  return DecodeAttention{q, k_cache.data_ptr(), v_cache.data_ptr(), kv_kind(k_cache),
                         rows, heads, kv_heads, dim, tables, width, lens, block_size, static_cast<float>(scale),
                         window, out, per, items, std::move(tiles), prefetch > 0 ? prefetch : machine_prefetch().level};
}

std::string attention_prefetch() {
  const PrefetchChoice& c = machine_prefetch();
  return std::string(c.level == 3 ? "L1" : "L2") + " (" + c.why + ")";
}

int64_t decode_items(const DecodeAttention& a) { return a.items; }

int64_t decode_scratch(const DecodeAttention& a) { return a.per * (a.block_size + a.dim + 2); }

void decode_item_range(const DecodeAttention& a, int64_t begin, int64_t end, float* scratch) {
#if defined(__AVX512F__) || defined(DI_ATTN_AVX2)
  if (!a.tiles.empty()) {
    if (a.kind == kKVBf16) tiles_of<uint16_t>(a, begin, end, scratch);
    else if (a.kind == kKVFp8) tiles_of<uint8_t>(a, begin, end, scratch);
    else tiles_of<float>(a, begin, end, scratch);
    return;
  }
#endif
  if (a.kind == kKVBf16) items_of<uint16_t>(a, begin, end, scratch);
  else if (a.kind == kKVFp8) items_of<uint8_t>(a, begin, end, scratch);
  else items_of<float>(a, begin, end, scratch);
}

static void run_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, const int64_t* tp,
                     int64_t width, const int64_t* lp, int64_t block_size, double scale, int64_t window,
                     torch::Tensor out, int64_t prefetch) {
  const DecodeAttention a = decode_attention(q.data_ptr<float>(), k_cache, v_cache, q.size(0), q.size(1), tp, width,
                                             lp, block_size, scale, window, out.data_ptr<float>(),
                                             at::get_num_threads(), static_cast<int>(prefetch));
  at::parallel_for(0, decode_items(a), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(decode_scratch(a));
    decode_item_range(a, begin, end, scratch.data());
  });
}

static void check(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat && v_cache.scalar_type() == kv &&
              (kv == torch::kFloat || kv == torch::kBFloat16 || kv == torch::kFloat8_e4m3fn),
              "paged attention kernel: float32 queries, a float32, bfloat16 or float8_e4m3fn cache");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged attention kernel: contiguous tensors only");
  const int64_t dim = q.size(2);
  TORCH_CHECK(v_cache.size(2) == dim && k_cache.size(2) == dim && (dim == 64 || dim == 128 || dim == 256),
              "paged attention kernel: head dims 64, 128 or 256 with equal K and V dims");
}

// Decode: row n is one query at position lens[n] - 1 with its own block table.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, int64_t block_size, double scale, int64_t window, int64_t prefetch) {
  check(q, k_cache, v_cache);
  tables = tables.contiguous();
  lens = lens.contiguous();
  auto out = torch::empty_like(q);
  run_rows(q, k_cache, v_cache, tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), block_size,
           scale, window, out, prefetch);
  return out;
}

// Prefill: T consecutive queries of one sequence at positions first_position..first_position+T-1, one block table;
// each query runs exactly the decode computation for its own position.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                            int64_t first_position, int64_t block_size, double scale, int64_t window,
                            int64_t prefetch) {
  check(q, k_cache, v_cache);
  table = table.contiguous();
  auto lens = torch::arange(first_position + 1, first_position + q.size(0) + 1, table.options());
  auto out = torch::empty_like(q);
  run_rows(q, k_cache, v_cache, table.data_ptr<int64_t>(), 0, lens.data_ptr<int64_t>(), block_size, scale, window,
           out, prefetch);
  return out;
}
