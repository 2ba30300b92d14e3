"""A paged decode-attention kernel for the CPU: one pass over each sequence's cached K/V, straight from its blocks.

The torch path gathers every decode row's blocks into a padded copy and then runs SDPA over it: at long contexts
and large batches that moves the KV cache three to four times per step. This kernel reads each cached key and
value once: per (sequence, KV head) it scores the G query heads that share the KV head against one block of keys,
rescales a running max / sum / weighted value sum (online softmax, one rescale per block), and writes
acc / sum. float32 only; sliding windows start at max(0, len - W). Built once with torch's cpp_extension (g++,
ninja) into torch's extension cache; if that fails the engine logs why and keeps the torch path.
"""
from __future__ import annotations

import functools
import logging
from types import ModuleType

logger = logging.getLogger("deepinfer")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// One (sequence, KV head) item: G query heads against the keys first..len-1 of one sequence.
template <int DIM>
static void attend(const float* __restrict__ qh, const float* __restrict__ kp, const float* __restrict__ vp,
                   const int64_t* __restrict__ table, int64_t first, int64_t len, int64_t block_size,
                   int64_t kv_heads, int64_t h, int64_t group, float scale, float* __restrict__ out,
                   float* __restrict__ scores, float* __restrict__ acc, float* __restrict__ row_max,
                   float* __restrict__ row_sum) {
  const int64_t stride = kv_heads * DIM;  // floats between consecutive tokens of one head
  for (int64_t g = 0; g < group; ++g) { row_max[g] = -INFINITY; row_sum[g] = 0.f; }
  for (int64_t i = 0; i < group * DIM; ++i) acc[i] = 0.f;
  for (int64_t start = first; start < len;) {
    const int64_t block = start / block_size, stop = std::min(len, (block + 1) * block_size), count = stop - start;
    const int64_t row0 = (table[block] * block_size + start - block * block_size) * kv_heads + h;
    const float* __restrict__ kb = kp + row0 * DIM;
    const float* __restrict__ vb = vp + row0 * DIM;
    for (int64_t i = 0; i < count; ++i) {  // each key read once, scored for the G query heads sharing it
      const float* __restrict__ k = kb + i * stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* __restrict__ qg = qh + g * DIM;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < DIM; ++d) dot += qg[d] * k[d];
        scores[g * block_size + i] = dot * scale;
      }
    }
    for (int64_t g = 0; g < group; ++g) {  // one rescale per block
      float* __restrict__ sg = scores + g * block_size;
      float block_max = -INFINITY;
      for (int64_t i = 0; i < count; ++i) block_max = std::max(block_max, sg[i]);
      const float new_max = std::max(row_max[g], block_max);
      const float rescale = std::exp(row_max[g] - new_max);
      row_max[g] = new_max;
      float sum = 0.f;
      for (int64_t i = 0; i < count; ++i) {
        sg[i] = std::exp(sg[i] - new_max);
        sum += sg[i];
      }
      row_sum[g] = row_sum[g] * rescale + sum;
      float* __restrict__ a = acc + g * DIM;
#pragma omp simd
      for (int d = 0; d < DIM; ++d) a[d] *= rescale;
    }
    for (int64_t i = 0; i < count; ++i) {  // each value read once
      const float* __restrict__ v = vb + i * stride;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * block_size + i];
        float* __restrict__ a = acc + g * DIM;
#pragma omp simd
        for (int d = 0; d < DIM; ++d) a[d] += p * v[d];
      }
    }
    start = stop;
  }
  for (int64_t g = 0; g < group; ++g)
    for (int d = 0; d < DIM; ++d) out[g * DIM + d] = acc[g * DIM + d] / row_sum[g];
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
              v_cache.scalar_type() == torch::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous() &&
              lens.is_contiguous(), "paged_decode: contiguous tensors only");
  const int64_t n_rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), width = tables.size(1), group = heads / kv_heads;
  TORCH_CHECK(v_cache.size(2) == dim && (dim == 64 || dim == 128 || dim == 256),
              "paged_decode: head dims 64, 128 or 256 with equal K and V dims");
  auto out = torch::empty({n_rows, heads, dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n_rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * block_size), acc(group * dim), row_max(group), row_sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / kv_heads, h = item % kv_heads, len = lp[n];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const float* qh = qp + (n * heads + h * group) * dim;
      float* o = op + (n * heads + h * group) * dim;
      auto run = [&](auto fn) {
        fn(qh, kp, vp, tp + n * width, first, len, block_size, kv_heads, h, group, sc, o, scores.data(), acc.data(),
           row_max.data(), row_sum.data());
      };
      if (dim == 64) run(attend<64>);
      else if (dim == 128) run(attend<128>);
      else run(attend<256>);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
"""


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel module, built on first use and cached by torch; None if it cannot be built here."""
    try:
        import torch
        from torch.utils.cpp_extension import load_inline

        # -march=native: the build is per instruction set, so its name says which (a shared cache stays safe)
        return load_inline(
            name=f"deepinfer_cpu_attention_v3_{torch.backends.cpu.get_cpu_capability().lower()}",
            cpp_sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path still works
        logger.warning("CPU paged-attention kernel unavailable (%s: %s); using the torch path",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
