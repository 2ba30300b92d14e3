// The per-layer work between matmuls, fused: one call instead of five to ten small torch ops each. float32.
// Every row is computed on its own, in an order fixed by its width: results do not depend on the batch, the
// thread count or the tile a row falls in.
#include "aten.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vexp.h"

namespace {

constexpr int kLanes = 16;  // independent partial sums per row: vectorisable without reassociating

// act(gate) * up with the exp of vexp.h, written once for one value and for 8 or 16 lanes (the same operations in
// the same order: the same bits in a vector body and in a row's scalar tail).
// SiLU: g / (1 + exp(-g)); GELU (tanh form): 0.5 g (1 + tanh(c0 (g + c1 g^3))), tanh(y) = 1 - 2 / (exp(2y) + 1).
constexpr float kGelu0 = 0.7978845608028654f, kGelu1 = 0.044715f;

template <typename V>
inline V silu(V g, V u) { return g / (1.f + exp_lanes(-g)) * u; }

template <typename V>
inline V gelu(V g, V u) {
  const V g3 = g * g * g;
  const V y = kGelu0 * (g + kGelu1 * g3);
  const V t = 1.f - 2.f / (exp_lanes(2.f * y) + 1.f);
  return 0.5f * g * (1.f + t) * u;
}

inline float sum_squares(const float* x, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += x[i + l] * x[i + l];
  for (int l = 0; i < n; ++i, ++l) part[l] += x[i] * x[i];
  for (int w = kLanes / 2; w > 0; w /= 2)  // pairwise, fixed
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

}  // namespace

void rms_norm_row(const float* row, float* res, const float* wo, int64_t H, float eps, float* o) {
  if (res != nullptr) {
    for (int64_t i = 0; i < H; ++i) res[i] += row[i];
    row = res;
  }
  const float scale = 1.f / std::sqrt(sum_squares(row, H) / (float)H + eps);
  for (int64_t i = 0; i < H; ++i) o[i] = (row[i] * scale) * wo[i];
}

void act_row(const float* g, const float* u, float* o, int64_t I, int64_t act) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= I; i += 16) {
    const __m512 v = _mm512_loadu_ps(g + i), w = _mm512_loadu_ps(u + i);
    _mm512_storeu_ps(o + i, act == 0 ? silu(v, w) : gelu(v, w));
  }
#elif defined(DI_VEXP_AVX2)
  for (; i + 8 <= I; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i), w = _mm256_loadu_ps(u + i);
    _mm256_storeu_ps(o + i, act == 0 ? silu(v, w) : gelu(v, w));
  }
#endif
  for (; i < I; ++i) o[i] = act == 0 ? silu(g[i], u[i]) : gelu(g[i], u[i]);
}

void rotary_row(float* base, int64_t heads, int64_t D, const float* c, const float* s, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    float* x = base + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
      x[i] = a - b;
      x[i + half] = e + f;
    }
  }
}

// float32 -> bfloat16 bits as torch's .to(torch.bfloat16) gives them: rounded to nearest even, every NaN to 0xFFFF
// (its vectorised conversion's NaN); branch-free apart from the NaN select, so the compiler vectorises the loops.
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return f != f ? (uint16_t)0xFFFF : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float32 -> float8 e4m3fn bits as torch's .to(torch.float8_e4m3fn) gives them (c10's conversion, step for step:
// rounded to nearest even, a magnitude past 448 saturated to 448, NaN to 0x7F), written with selects instead of
// branches so the compiler vectorises the loops.
static inline uint8_t fp8_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u, a = u ^ sign;
  float af, small;
  std::memcpy(&af, &a, 4);
  const uint32_t denorm = 141u << 23;  // below 2^-6: add 2^14, so the float unit rounds to the subnormal step
  float magic;
  std::memcpy(&magic, &denorm, 4);
  small = af + magic;
  uint32_t sb;
  std::memcpy(&sb, &small, 4);
  const uint32_t r_small = sb - denorm;
  uint32_t r_norm = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  r_norm = r_norm == 0x7Fu ? 0x7Eu : r_norm;
  const uint32_t r = a >= (1087u << 20) ? (a > 0x7F800000u ? 0x7Fu : 0x7Eu) : a < (121u << 23) ? r_small : r_norm;
  return (uint8_t)(r | (sign >> 24));
}

KVKind kv_kind(const torch::Tensor& cache) {
  const auto t = cache.scalar_type();
  TORCH_CHECK(t == torch::kFloat || t == torch::kBFloat16 || t == torch::kFloat8_e4m3fn,
              "KV cache: float32, bfloat16 or float8_e4m3fn, got ", t);
  return t == torch::kFloat ? kKVFloat : t == torch::kBFloat16 ? kKVBf16 : kKVFp8;
}

// k and v rounded by `bits` into slot `slot` of caches of T
template <typename T, typename Round>
static inline void narrow_row(const float* k, const float* v, void* k_cache, void* v_cache, int64_t slot, int64_t kw,
                              int64_t vw, Round bits) {
  T* kc = static_cast<T*>(k_cache) + slot * kw;
  T* vc = static_cast<T*>(v_cache) + slot * vw;
  for (int64_t i = 0; i < kw; ++i) kc[i] = bits(k[i]);
  for (int64_t i = 0; i < vw; ++i) vc[i] = bits(v[i]);
}

void cache_row(const float* k, const float* v, void* k_cache, void* v_cache, KVKind kind, int64_t slot, int64_t kw,
               int64_t vw) {
  if (kind == kKVBf16) return narrow_row<uint16_t>(k, v, k_cache, v_cache, slot, kw, vw, bf16_bits);
  if (kind == kKVFp8) return narrow_row<uint8_t>(k, v, k_cache, v_cache, slot, kw, vw, fp8_bits);
  std::memcpy(static_cast<float*>(k_cache) + slot * kw, k, kw * sizeof(float));
  std::memcpy(static_cast<float*>(v_cache) + slot * vw, v, vw * sizeof(float));
}

// y = x / sqrt(mean(x^2) + eps) * (w + offset), rows of x [T, H] (any row stride). With `residual`, first
// residual += x (in place) and the norm is taken of the sum: a decoder layer's add-then-norm in one pass.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset,
                       c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.stride(1) == 1, "rms_norm: float32 [T, H] rows");
  const int64_t T = x.size(0), H = x.size(1), sx = x.stride(0);
  auto out = torch::empty({T, H}, x.options());
  auto w = weight.contiguous();
  std::vector<float> wo(H);
  for (int64_t i = 0; i < H; ++i) wo[i] = w.data_ptr<float>()[i] + (float)offset;
  float* res = nullptr;
  int64_t sr = 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == torch::kFloat && residual->size(0) == T && residual->size(1) == H &&
                residual->stride(1) == 1, "rms_norm: residual must be float32 [T, H] rows");
    res = residual->data_ptr<float>();
    sr = residual->stride(0);
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rms_norm_row(xp + t * sx, res != nullptr ? res + t * sr : nullptr, wo.data(), H, (float)eps, op + t * H);
  });
  return out;
}

// [T, 2I] (gate | up) -> act(gate) * up [T, I]; act: 0 SiLU, 1 GELU (tanh approximation).
torch::Tensor act_and_mul(torch::Tensor x, int64_t act) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) % 2 == 0, "act_and_mul: float32 [T, 2I]");
  x = x.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) act_row(xp + t * 2 * I, xp + t * 2 * I + I, op + t * I, I, act);
  });
  return out;
}

// In place on q [T, Hq, D] and k [T, Hk, D] (views into the qkv output: any token stride, heads contiguous):
// the first rotary_dim values of each head rotate by the position's angle in the rotate-half layout,
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product rounded, as the torch path computes it.
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat, "rotary_: float32 q, k");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary_: heads must be contiguous");
  positions = positions.contiguous().to(torch::kLong);
  const int64_t T = q.size(0), half = cos.size(1), D = q.size(2);
  TORCH_CHECK(2 * half <= D && cos.is_contiguous() && sin.is_contiguous(), "rotary_: bad cos / sin tables");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_: position out of range");
  auto apply = [&](float* base, int64_t heads, int64_t stride) {
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rotary_row(base + t * stride, heads, D, cp + pos[t] * half, sp + pos[t] * half, half);
    });
  };
  apply(q.data_ptr<float>(), q.size(1), q.stride(0));
  apply(k.data_ptr<float>(), k.size(1), k.stride(0));
}

// k [T, Hk, D] and v [T, Hk, Dv] (views, heads contiguous) -> rows `slots` of the caches [S, Hk, D] / [S, Hk, Dv].
void cache_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  // float32 rows into a bfloat16 or float8 cache are rounded as torch's .to(cache dtype) rounds them
  const auto kc_type = k_cache.scalar_type();
  const bool narrow = k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
                      v_cache.scalar_type() == kc_type &&
                      (kc_type == torch::kBFloat16 || kc_type == torch::kFloat8_e4m3fn);
  TORCH_CHECK(narrow || (k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type()),
              "cache_write: dtype mismatch");
  slots = slots.contiguous().to(torch::kLong);
  const int64_t T = k.size(0), S = k_cache.size(0);
  const int64_t kw = k.size(1) * k.size(2), vw = v.size(1) * v.size(2);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2) &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.numel() == S * kw &&
              v_cache.numel() == S * vw, "cache_write: layout");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "cache_write: slot out of range");
  if (narrow) {  // a prefill chunk writes thousands of rows: shared by the threads, each row by one
    const float* kb = k.data_ptr<float>();
    const float* vb = v.data_ptr<float>();
    void* kc = k_cache.data_ptr();
    void* vc = v_cache.data_ptr();
    const int64_t sk = k.stride(0), sv = v.stride(0);
    const KVKind kind = kv_kind(k_cache);
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) cache_row(kb + t * sk, vb + t * sv, kc, vc, kind, sl[t], kw, vw);
    });
    return;
  }
  const int64_t es = k.element_size();
  auto* kb = static_cast<char*>(k.data_ptr());
  auto* vb = static_cast<char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + sl[t] * kw * es, kb + t * k.stride(0) * es, kw * es);
    std::memcpy(vc + sl[t] * vw * es, vb + t * v.stride(0) * es, vw * es);
  }
}
