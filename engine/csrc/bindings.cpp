// The Python module: one per ISA level, the same sources compiled with that level's flags (engine/cpu_kernels.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace peregrine;
  // The GIL is released while a kernel runs, as torch's own ops do, so the server's event loop keeps going.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("add_rms_norm_", &add_rms_norm_, "h += delta; RMSNorm(h), Llama rounding", release());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache", release());
  m.def("linear_bf16", &linear_bf16, "bf16 x[M, K] @ w[N, K]^T (+ bias), AVX512-BF16", release());
  m.def("amx_available", &amx_available, "this CPU has AMX-BF16 and Linux lets the process use it");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (NaN largest)", release());
  bind_decoder(m);
}
