// The compiled CPU ops of one extension module (ops/cpu_ops.py builds it), as the bindings expose them; the
// row- and block-level pieces they share with the decode stack are in kernels.h.
#pragma once
#include "aten.h"

#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                           int64_t bits, int64_t group, double c, int64_t n, c10::optional<torch::Tensor> bias);
torch::Tensor quant_rows(torch::Tensor ids, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t group, double c, int64_t k);
std::string isa();
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset,
                       c10::optional<torch::Tensor> residual);
torch::Tensor act_and_mul(torch::Tensor x, int64_t act);
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void cache_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, int64_t block_size, double scale, int64_t window, int64_t prefetch);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                            int64_t first_position, int64_t block_size, double scale, int64_t window,
                            int64_t prefetch);
std::string attention_prefetch();  // the cache level decode attention prefetches into on this machine, and why
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor sample_id_order(torch::Tensor weights, torch::Tensor u);
std::tuple<torch::Tensor, torch::Tensor> sort_descending(torch::Tensor x);
torch::Tensor row_sums(torch::Tensor weights);
std::vector<torch::Tensor> ordered_prefix(torch::Tensor x, int64_t k);
std::tuple<torch::Tensor, torch::Tensor> sample_sorted(torch::Tensor weights, torch::Tensor limit, torch::Tensor top_k,
                                                       torch::Tensor top_p, torch::Tensor id_total, torch::Tensor u,
                                                       torch::Tensor usable, torch::Tensor complete);
torch::Tensor quant_linear_argmax(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                                  int64_t bits, int64_t group, double c, int64_t n);
// bounded_argmax.cpp: quant_linear_argmax's index for an 8-bit symmetric head in two passes (the top 6 bits of each
// quant bound every output, only blocks that can hold the largest are computed exactly); bound from
// quant_argmax_bound ([nb, 2, 16]: per output the bound's factors of ||x||_2 and ||x||_1)
torch::Tensor quant_argmax_bound(torch::Tensor quants, torch::Tensor scales, int64_t k);
torch::Tensor quant_argmax_bounded(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                                   int64_t bits, int64_t group, double c, int64_t n, torch::Tensor bound);
// amx_linear.cpp: many rows on AMX tiles against a quantized weight dequantized to bfloat16 as it goes (quant_linear's
// weight arguments; throws where the build has no AMX)
// amx_attention.cpp: one prefill chunk's attention on AMX tiles (prompt rows; a bfloat16 cache)
torch::Tensor amx_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                            int64_t first_position, int64_t block_size, double scale, int64_t window);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t group, double c, int64_t n, c10::optional<torch::Tensor> bias);
// split_head.cpp: an 8-bit symmetric LM head stored as a 5-bit high plane and 3 low bit planes
torch::Tensor split_head_linear(torch::Tensor x, torch::Tensor high, torch::Tensor low, torch::Tensor scales, int64_t n);
torch::Tensor split_head_rows(torch::Tensor ids, torch::Tensor high, torch::Tensor low, torch::Tensor scales, int64_t k);
torch::Tensor split_head_argmax(torch::Tensor x, torch::Tensor high, torch::Tensor low, torch::Tensor scales,
                                torch::Tensor bound, int64_t n, int64_t max_rows);

// A decoder stack computing decode rows (one query token each) in one call. Per layer, with the norms a layer has
// (Llama: input and pre-FFN; Gemma 3: all six):
//   h = norm_in(res); qkv = Wqkv h (+ b); q, k = norm_q(q), norm_k(k) per head; rotary(q, k); cache <- k, v;
//   a = attention (the layer's group's tables, its window); o = Wo a; o = norm_post_attn(o);
//   res += o; h = norm_pre_ffn(res); m = Wdown act(Wgate h) * (Wup h); m = norm_post_ffn(m); res += m;
// and the next layer's norm_in (the final norm after the last), each step the row or block code of the op the
// module path calls, in the same order: the same bits, in one parallel region (barriers between phases instead of
// a thread fork per op) and without Python between.
class DecodeStack {
 public:
  // one quantized linear layer: quants, scales, offsets, bits, group, c, n, bias
  using Linear = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, double, int64_t,
                            c10::optional<torch::Tensor>>;
  enum Norm { kIn, kPostAttn, kPreFfn, kPostFfn, kQ, kK, kNorms };
  // linears: 4 per layer (qkv, o, gate_up, down); norms, eps, offsets: every norm weight once; norm_index: kNorms
  // per layer (an index into norms, or -1: the layer has no such norm) and the final norm's; windows, groups
  // (which tables the layer attends through), cos, sin, caches: per layer; shape: num_heads, num_kv_heads,
  // head_dim; act: 0 SiLU, 1 GELU (tanh).
  DecodeStack(std::vector<Linear> linears, std::vector<torch::Tensor> norms, std::vector<double> eps,
              std::vector<double> offsets, std::vector<int64_t> norm_index, std::vector<int64_t> windows,
              std::vector<int64_t> groups, std::vector<int64_t> shape, double scale, int64_t act,
              std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, std::vector<torch::Tensor> k_caches,
              std::vector<torch::Tensor> v_caches, bool tiles);
  // x [T, H] the embedded tokens -> [T, H] the final norm of the last layer's output; slots, tables, lens: per
  // group of layers. tiles (constructor): whether rows tile_from.. may go to AMX tiles (amx_linear.cpp: rounded to
  // bfloat16 instead of int8, each weight dequantized to bfloat16 tiles as it goes); the rows before run on the
  // blocks (tile_from < 0: every row on the blocks).
  //
  // An MTP draft layer's stack (one layer) may have an input stage (set_input: the embedding norm, the hidden-state
  // norm and the projection W_eh, DeepSeek-V3 §2.2): forward with `hidden` then takes x as the embedded next tokens
  // and computes the layer's input W_eh [enorm(x) ; hnorm(hidden)] first, as the module path does. Rows full_rows..
  // (one layer only) stop once their K and V are cached: the K/V-only upkeep of rows whose output nobody reads; the
  // result then has full_rows rows.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> slots,
                        std::vector<torch::Tensor> tables, std::vector<torch::Tensor> lens, int64_t block_size,
                        int64_t tile_from, c10::optional<torch::Tensor> hidden, int64_t full_rows) const;
  // norms: the embedding's and the hidden state's norm weights, with their eps and offsets; eh: W_eh [H, 2H]
  void set_input(std::vector<torch::Tensor> norms, std::vector<double> eps, std::vector<double> offsets, Linear eh);

 private:
  const float* norm(size_t layer, Norm which) const;  // w + offset, or nullptr
  float eps(size_t layer, Norm which) const;

  std::vector<Linear> linears_;
  std::vector<QuantView> views_;  // of linears_ (which keep the tensors alive)
  std::vector<std::vector<float>> wo_;  // norm weights + offset, as rms_norm adds it
  std::vector<double> eps_;
  std::vector<int64_t> norm_index_, windows_, groups_;
  int64_t heads_, kv_heads_, head_dim_;
  int64_t max_positions_;  // rows of the smallest rotary table
  double scale_;
  int64_t act_;
  std::vector<torch::Tensor> cos_, sin_, k_caches_, v_caches_;
  bool tiles_;  // rows may go to AMX tiles
  // the MTP input stage (set_input), when set: norm weights + offsets, eps, W_eh and its view
  std::vector<std::vector<float>> in_wo_;
  std::vector<double> in_eps_;
  std::vector<Linear> in_linear_;
  std::vector<QuantView> in_view_;
};
