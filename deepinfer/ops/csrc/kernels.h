// Row- and block-level pieces of the compiled ops, shared by the torch-level ops (which run them under
// at::parallel_for) and the decode stack (which runs them inside one parallel region): the same code either way,
// so the same bits.
#pragma once
#include "aten.h"

#include <cstdint>
#include <utility>
#include <vector>

// quant_linear.cpp: a packed quantized weight (see the layout there), and activations rounded to int8 per row.
struct QuantView {
  const uint8_t* quants;
  const void* scales;  // uint16_t (float16 bits) or float
  const void* offsets;  // same type; nullptr for symmetric formats
  float c;
  int64_t bits, group, nb, k;  // nb: blocks of 16 output rows
  bool half, affine;
  const uint8_t* table = nullptr;  // a table format's 16 values: 4-bit quants index them (IQ4_NL, IQ4_XS)
  bool small = false;  // 8-bit records whose quants are all below 64 (passed as bits 6): AVX2 multiplies them unsigned
};
QuantView quant_view(const torch::Tensor& quants, const torch::Tensor& scales, const torch::Tensor& offsets,
                     int64_t bits, int64_t group, double c, int64_t k);
// x [K] -> xq [K] int8, xd [K / 32] scales, xs [K / 16] sums of xq per 16, xt [3K / 32] d * float(sum) per 16
// then per 32
void quantize_row(const float* x, int64_t K, int8_t* xq, float* xd, int32_t* xs, float* xt);
// output blocks begin..end-1 (16 columns each) of M rows: out[m * ldo + 16 * (b - col0) + j] (col0: the block
// whose first column is out's column 0)
void quant_blocks(const QuantView& w, const int8_t* xq, const float* xd, const int32_t* xs, const float* xt,
                  int64_t M, float* out, int64_t ldo, int64_t begin, int64_t end, int64_t col0 = 0);
// x [M, K] float32 rounded by quantize_row, rows shared by the threads (the inputs of quant_blocks)
struct QuantActs {
  torch::Tensor xq, xd, xs, xt;
};
QuantActs quantize_acts(const torch::Tensor& x);

// amx_linear.cpp: bfloat16 on AMX tiles. The others run only where amx_ready() (built with the tiles, and the OS
// granted this process tile state); amx_configure() on the thread before amx_items.
bool amx_ready();
void amx_configure();
void amx_release();
void amx_round_row(const float* x, int64_t K, uint16_t* a);  // x [K] -> bfloat16 bits, nearest even
// items begin..end-1 of y = a W^T (+ bias): a [M, K] bfloat16 rows, zeros past M up to a multiple of 16; W the
// packed blocks of a quantized weight (w.nb blocks of 16 columns, N of them valid), dequantized to bfloat16 tiles
// as the items need them; y rows ldy apart. An item is a pair of column blocks over a block of rows
// (amx_linear.cpp); every output is the same tile instructions over K in order.
int64_t amx_num_items(int64_t M, int64_t nb, int64_t K);
void amx_items(const uint16_t* a, const QuantView& w, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
               const float* bias, int64_t begin, int64_t end);
// amx_attention.cpp: prompt rows' attention on AMX tiles (bfloat16 cache only). A run is consecutive queries of one
// sequence: rows row0..row0+count-1 of q / out at positions pos0.., one block table; the plan fills the rest. Two
// passes, each split into items among the threads: amx_attention_prepare (the keys and values as tiles, into the
// caller's `tiles`), then, on threads with the tiles configured, amx_attention_items.
struct AmxAttnRun {
  int64_t row0 = 0, count = 0, pos0 = 0;
  const int64_t* table = nullptr;
  int64_t kb0 = 0, nkb = 0, prep0 = 0, item0 = 0, offset = 0;  // key blocks kb0.., first items, offset in the room
};
struct AmxAttention {
  const float* q = nullptr;  // row t, head hq at q + t * q_stride + hq * dim
  int64_t q_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  const uint16_t* k_cache = nullptr;  // bfloat16 bits [slots, kv_heads, dim]
  const uint16_t* v_cache = nullptr;
  int64_t heads = 0, kv_heads = 0, dim = 0, block_size = 0, window = -1;
  float scale = 1.f;
  std::vector<AmxAttnRun> runs;
  int64_t prep_items = 0, items = 0;
  int64_t room = 0;           // uint16 values the prepared tiles take
  uint16_t* tiles = nullptr;  // where they go (64-byte aligned, room values): set by the caller before preparing
};
AmxAttention amx_attention_plan(const float* q, int64_t q_stride, const torch::Tensor& k_cache,
                                const torch::Tensor& v_cache, int64_t heads, std::vector<AmxAttnRun> runs,
                                int64_t block_size, double scale, int64_t window, float* out, int64_t out_stride);
void amx_attention_prepare(const AmxAttention& a, int64_t begin, int64_t end);
void amx_attention_items(const AmxAttention& a, int64_t begin, int64_t end);
bool amx_attention_built();
// the first 64-byte boundary in p (a room of room + 32 values holds room values from there)
inline uint16_t* amx_aligned64(uint16_t* p) { return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64 / 2; }

// layer_ops.cpp: one row each.
// out = x / sqrt(mean(x^2) + eps) * wo; with res: res += x first and the norm is of the sum (wo = weight + offset)
void rms_norm_row(const float* x, float* res, const float* wo, int64_t H, float eps, float* out);
// o[0..I) = act(g) * u; act: 0 SiLU, 1 GELU (tanh)
void act_row(const float* g, const float* u, float* o, int64_t I, int64_t act);
// rotate-half RoPE of `heads` heads of D values (the first 2 * half of each) at one position's cos / sin
void rotary_row(float* x, int64_t heads, int64_t D, const float* c, const float* s, int64_t half);
// What a KV cache stores: float32, bfloat16 bits, or float8 e4m3fn bits (vLLM's `--kv-cache-dtype fp8`).
enum KVKind : int { kKVFloat = 0, kKVBf16 = 1, kKVFp8 = 2 };
KVKind kv_kind(const torch::Tensor& cache);  // throws for any other dtype
// float32 k [kw] and v [vw] into cache slot `slot`, rounded as torch's .to(cache dtype) rounds them
void cache_row(const float* k, const float* v, void* k_cache, void* v_cache, KVKind kind, int64_t slot, int64_t kw,
               int64_t vw);

// attention.cpp: paged decode attention split into items. Item i is the query heads [i * Q / items, (i + 1) * Q /
// items) of all Q = rows * heads, run as the pieces that share a KV head: a row's G heads of one KV head per item
// when there are many rows, or `items` = the threads when there are few (a KV head read once per thread that
// needs it, the heads split evenly); scratch is per thread: decode_scratch floats.
struct DecodeAttention {
  const float* q;  // [rows, heads, dim]
  const void* k_cache;  // float, uint16_t (bfloat16 bits) or uint8_t (e4m3fn bits) [slots, kv_heads, dim]
  const void* v_cache;
  KVKind kind;
  int64_t rows, heads, kv_heads, dim;
  const int64_t* tables;  // [rows, width]
  int64_t width;
  const int64_t* lens;
  int64_t block_size;
  float scale;
  int64_t window;
  float* out;  // [rows, heads, dim]
  int64_t per;  // most query heads of one piece (sizes the scratch)
  int64_t items;
  // query tiles (AVX-512, AVX2): (first row, rows) of consecutive rows of one sequence read together, a single row being
  // (row, 1); item i is tile i / kv_heads's queries of KV head i % kv_heads. Empty: no tiles (items as above).
  std::vector<std::pair<int64_t, int64_t>> tiles;
  int prefetch;  // the cache level the AVX-512 loops prefetch into: 3 (L1) or 2 (L2); no value depends on it
};
DecodeAttention decode_attention(const float* q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 int64_t rows, int64_t heads, const int64_t* tables, int64_t width,
                                 const int64_t* lens, int64_t block_size, double scale, int64_t window, float* out,
                                 int threads, int prefetch = 0);  // prefetch 0: the machine's (prefetch_level.h)
int64_t decode_items(const DecodeAttention& a);
int64_t decode_scratch(const DecodeAttention& a);
// slots begin..end-1: the items in an order whose contiguous ranges mix short and long rows (attention.cpp)
void decode_item_range(const DecodeAttention& a, int64_t begin, int64_t end, float* scratch);
