// The part of torch's C++ API the kernels use (tensors, empty / empty_like / arange, parallel_for), without
// <torch/types.h>: that header pulls in the whole API and costs ~12 s of parsing per source file, this one ~5 s,
// which is most of a build's time on a small machine. `torch::` names resolve to ATen's, as in torch/types.h.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace torch {
using namespace at;  // NOLINT: torch/types.h does the same
}  // namespace torch
