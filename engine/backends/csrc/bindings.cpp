// The Python module: one per ISA level, the same sources compiled with that level's flags (engine/backends/cpu_kernels.py).
#include "kernels.h"

namespace peregrine {

const char* isa() { return PEREGRINE_BUILD; }

}  // namespace peregrine

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace peregrine;
  // The GIL is released while a kernel runs, as torch's own ops do, so the server's event loop keeps going.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("isa", &isa, "the build: avx512_bf16, avx512, avx_vnni, avx2 (cpu_features' levels), neon or scalar");
  m.def("add_rms_norm_", &add_rms_norm_, "h += delta; RMSNorm(h), Llama rounding", release());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache", release());
  m.def("linear_small", &linear_small, "x[M, K] @ w[N, K]^T (+ bias), float32 or bfloat16, a few rows", release());
  // Positional, bias required (None for none), like every other kernel here: on an Intel Xeon with AMX under torch
  // 2.11 this was the one binding with named and default arguments, and the one whose refusals crashed the process
  // (the others raised cleanly there). Whether this form raises cleanly there is not yet verified.
  m.def("qlinear", &qlinear, "x[M, K] @ W^T (+ bias or None), W GGUF blocks [N, bytes] of a ggml type; int8 dots",
        release());
  m.def("qlinear_amx", &qlinear_amx, "qlinear with the tiled forms on AMX int8 tiles from 9 rows (same bits)",
        release());
  m.def("amx_int8_available", &amx_int8_available,
        "this build and CPU have AMX-INT8 and Linux lets the process use the tiles");
  m.def("tile_rows", &tile_rows,
        "rows a tile of the tiled Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q6_K forms this build multiplies (0: none)");
  m.def("amx_available", &amx_available, "this build and CPU have AMX-BF16 and Linux lets the process use it");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (NaN largest)", release());
  bind_decoder(m);
}
