// One extension module for deepinfer's compiled CPU ops (ops/cpu_ops.py builds it).
#include <torch/extension.h>

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                           int64_t bits, int64_t group, double c, int64_t n, c10::optional<torch::Tensor> bias);
torch::Tensor quant_rows(torch::Tensor ids, torch::Tensor quants, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t group, double c, int64_t k);
std::string isa();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset,
                       c10::optional<torch::Tensor> residual);
torch::Tensor act_and_mul(torch::Tensor x, int64_t act);
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void cache_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // compute ops release the GIL: with overlap scheduling the engine thread runs while the forward computes
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("quant_linear", &quant_linear, "x @ dequant(W)^T on packed block-quantized weights", nogil);
  m.def("quant_rows", &quant_rows, "dequantized rows of packed block-quantized weights (embedding lookup)", nogil);
  m.def("isa", &isa, "the instruction set this build computes with");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, optionally after residual += x", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("offset"), py::arg("residual") = py::none(), nogil);
  m.def("act_and_mul", &act_and_mul, "act(gate) * up for [T, 2I] rows (0: SiLU, 1: GELU tanh)", nogil);
  m.def("rotary_", &rotary_, "rotate-half RoPE in place on q and k views", nogil);
  m.def("cache_write", &cache_write, "k, v rows into their KV cache slots", nogil);
}
