// One extension module for deepinfer's compiled CPU ops (ops/cpu_ops.py builds it).

// torch's pybind11 type casters (tensors, optional, vectors) without the rest of <torch/extension.h>: half the
// parse time of the build's slowest source
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // compute ops release the GIL: with overlap scheduling the engine thread runs while the forward computes
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("quant_linear", &quant_linear, "x @ dequant(W)^T on packed block-quantized weights", nogil);
  m.def("quant_rows", &quant_rows, "dequantized rows of packed block-quantized weights (embedding lookup)", nogil);
  m.def("isa", &isa, "the instruction set this build computes with");
  m.def("dense_linear", &dense_linear, "x @ W^T (+ b) on [P, K, 16] float32 panels, one fma chain in k order per output",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, optionally after residual += x", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("offset"), py::arg("residual") = py::none(), nogil);
  m.def("act_and_mul", &act_and_mul, "act(gate) * up for [T, 2I] rows (0: SiLU, 1: GELU tanh)", nogil);
  m.def("rotary_", &rotary_, "rotate-half RoPE in place on q and k views", nogil);
  m.def("cache_write", &cache_write, "k, v rows into their KV cache slots", nogil);
  m.def("paged_decode", &paged_decode, "paged decode attention: one query per row, its own block table",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lens"), py::arg("block_size"),
        py::arg("scale"), py::arg("window"), py::arg("prefetch") = 0, nogil);
  m.def("paged_prefill", &paged_prefill, "paged attention of consecutive queries of one sequence", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("table"), py::arg("first_position"), py::arg("block_size"),
        py::arg("scale"), py::arg("window"), py::arg("prefetch") = 0, nogil);
  m.def("attention_prefetch", &attention_prefetch,
        "the cache level decode attention prefetches into on this machine (prefetch 0), and why");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of float32 [N, V] rows, rows in parallel", nogil);
  m.def("sample_id_order", &sample_id_order,
        "seeded inverse-CDF sampling over token ids from float32 weights, sums in float64 (no cdf tensor)", nogil);
  m.def("sort_descending", &sort_descending,
        "torch.sort(x, dim=-1, descending=True, stable=True) of float32 [N, V] rows by radix sort, rows in parallel",
        nogil);
  m.def("ordered_prefix", &ordered_prefix,
        "the first k entries of each float32 row in (value descending, id ascending) order, as ordered_top", nogil);
  m.def("row_sums", &row_sums, "each float32 row's sum in float64, added in id order (cumsum's last entry)", nogil);
  m.def("sample_sorted", &sample_sorted,
        "top-k / top-p sampling on rows in probability order, sums in float64 (no cdf tensor)", nogil);
  m.def("quant_linear_argmax", &quant_linear_argmax,
        "argmax over the outputs of x @ dequant(W)^T per row, without the logits (an LM head's greedy token)", nogil);
  m.def("quant_argmax_bound", &quant_argmax_bound,
        "per output of an 8-bit symmetric head, [nb, 2, 16]: the bounds quant_argmax_bounded's first pass needs", nogil);
  m.def("quant_argmax_bounded", &quant_argmax_bounded,
        "quant_linear_argmax's index for an 8-bit symmetric head in two passes: the quants' top 6 bits bound every "
        "output, only blocks that can hold a row's largest are computed exactly", nogil);
  m.def("split_head_linear", &split_head_linear, "quant_linear's outputs for an 8-bit head stored as split planes",
        nogil);
  m.def("split_head_rows", &split_head_rows, "quant_rows' rows of an 8-bit table stored as split planes", nogil);
  m.def("split_head_argmax", &split_head_argmax,
        "quant_linear_argmax's index for an 8-bit head stored as split planes: the high plane bounds every output, "
        "only blocks that can hold the largest are computed exactly (up to max_rows rows)", nogil);
  m.def("amx_linear", &amx_linear, "x @ dequant(W)^T (+ b) on AMX tiles: x and W rounded to bfloat16 (W tile by "
        "tile from its blocks), float32 sums in k order (a row's bits do not depend on the batch)", py::arg("x"),
        py::arg("quants"), py::arg("scales"), py::arg("offsets"), py::arg("bits"), py::arg("group"), py::arg("c"),
        py::arg("n"), py::arg("bias") = py::none(), nogil);
  m.def("amx_attention", &amx_attention, "one sequence's consecutive queries against its bfloat16 cache on AMX "
        "tiles: queries and probabilities rounded to bfloat16, 32-key blocks fixed by position (a query's bits do "
        "not depend on its chunk)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("table"),
        py::arg("first_position"), py::arg("block_size"), py::arg("scale"), py::arg("window"), nogil);
  m.def("amx_bf16_available", &amx_ready,
        "whether this build has the AMX-BF16 kernel and the OS granted this process AMX tile state");
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())  // one per ISA build in a process
      .def(py::init<std::vector<DecodeStack::Linear>, std::vector<torch::Tensor>, std::vector<double>,
                    std::vector<double>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, double, int64_t, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>, bool>())
      .def("forward", &DecodeStack::forward, "decode rows through every layer and the final norm", py::arg("x"),
           py::arg("positions"), py::arg("slots"), py::arg("tables"), py::arg("lens"), py::arg("block_size"),
           py::arg("tile_from") = -1, py::arg("hidden") = py::none(), py::arg("full_rows") = -1, nogil)
      .def("set_input", &DecodeStack::set_input, "an MTP layer's input stage: W_eh [enorm(x) ; hnorm(hidden)]",
           py::arg("norms"), py::arg("eps"), py::arg("offsets"), py::arg("eh"));
}
