// scripts/bandwidth.py's hand-written read: the sum of a float32 buffer, four vector loads per step on every
// thread, the access pattern of a decode step's weight stream without its arithmetic. Built by the script with
// -march=native (not part of the engine): AVX-512 loads where the CPU has them, else AVX2, else the compiler's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

double stream_read(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() % 64 == 0, "stream_read: float32, % 64");
  const float* p = t.data_ptr<float>();
  std::vector<double> partial(at::get_num_threads() + 1, 0.0);
  at::parallel_for(0, t.numel() / 64, 4096, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = begin; i < end; ++i) {
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i * 64));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i * 64 + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i * 64 + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i * 64 + 48));
    }
    partial[at::get_thread_num()] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
    __m256 a[8];
    for (auto& v : a) v = _mm256_setzero_ps();
    for (int64_t i = begin; i < end; ++i)
      for (int j = 0; j < 8; ++j) a[j] = _mm256_add_ps(a[j], _mm256_loadu_ps(p + i * 64 + j * 8));
    alignas(32) float lanes[8];
    for (int j = 1; j < 8; ++j) a[0] = _mm256_add_ps(a[0], a[j]);
    _mm256_store_ps(lanes, a[0]);
    for (float v : lanes) partial[at::get_thread_num()] += v;
#else
    float acc[64] = {};
    for (int64_t i = begin; i < end; ++i)
      for (int j = 0; j < 64; ++j) acc[j] += p[i * 64 + j];
    for (float v : acc) partial[at::get_thread_num()] += v;
#endif
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

const char* isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_read", &stream_read, "sum of a float32 buffer, vector reads on all threads",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", &isa, "the vector width it was compiled for");
}
