// Matmuls on GGUF weights kept quantized (formats in quant.h), and the dequantization the prefill path and the
// embedding lookup use. Built once per ISA level by engine/backends/quant_kernels.py; the module name says which.
//
// linear: out[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step (1-16). Each thread takes a range of
// output rows; it dequantizes a few weight rows at a time into a buffer that stays in L1/L2 and multiplies them
// into every input row, so the weights are read from memory once per step whatever M is. Each
// output element is summed in the same order whatever M and the thread split are: results are batch invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "quant.h"

namespace peregrine_quant {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;  // AVX2 (and two SSE2 / NEON registers elsewhere)
#endif
typedef float vec __attribute__((vector_size(kLanes * 4)));
constexpr int kTile = 4;  // weight rows dequantized and multiplied together
constexpr int64_t kMaxRows = 16;

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

template <int T>
void dequant_rows(const uint8_t* w, int64_t ldw, float* out, int64_t K, int64_t r_begin, int64_t r_end) {
  for (int64_t r = r_begin; r < r_end; ++r) dequant_whole_row<T>(w + r * ldw, K, out + r * K);
}

// Output rows [n_begin, n_end): kTile weight rows at a time are dequantized into `tile` (float32, L1/L2-sized),
// then each input row is multiplied with all of them, its x loaded once per kTile weights. Each output element
// is one row-by-row dot product (two accumulators over K, in the same order for every M and tile position).
template <int T>
void linear_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t ldw, float* out, int64_t N,
                  int64_t n_begin, int64_t n_end, float* tile) {
  for (int64_t n = n_begin; n < n_end; n += kTile) {
    const int64_t rows = std::min<int64_t>(kTile, n_end - n);
    dequant_rows<T>(w + n * ldw, ldw, tile, K, 0, rows);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      vec acc[kTile][2] = {};
      for (int64_t k = 0; k < K; k += 2 * kLanes) {
        const vec x0 = loadv(xm + k), x1 = loadv(xm + k + kLanes);
        for (int r = 0; r < kTile; ++r) {
          acc[r][0] += loadv(tile + r * K + k) * x0;
          acc[r][1] += loadv(tile + r * K + k + kLanes) * x1;
        }
      }
      for (int64_t r = 0; r < rows; ++r) out[m * N + n + r] = hsum(acc[r][0] + acc[r][1]);
    }
  }
}

template <typename F>
void dispatch(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); break;
    case kQ5_0: f(std::integral_constant<int, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int, kQ5_1>{}); break;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); break;
    case kQ4_K: f(std::integral_constant<int, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int, kQ6_K>{}); break;
    case kIQ4_NL: f(std::integral_constant<int, kIQ4_NL>{}); break;
    case kIQ4_XS: f(std::integral_constant<int, kIQ4_XS>{}); break;
    case kQ4_0R: f(std::integral_constant<int, kQ4_0R>{}); break;
    case kQ4_1R: f(std::integral_constant<int, kQ4_1R>{}); break;
    case kQ8_0R: f(std::integral_constant<int, kQ8_0R>{}); break;
    default: TORCH_CHECK(false, "unsupported GGUF quantization type " + std::to_string(type));
  }
}

void check_weight(const torch::Tensor& w, int64_t type, int64_t K) {
  const Layout L = layout_of(type);
  TORCH_CHECK(L.elems > 0, "unsupported GGUF quantization type " + std::to_string(type));  // one string: qlinear.cpp
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.stride(1) == 1, "weight: 2-D uint8 rows of blocks");
  TORCH_CHECK(K % L.elems == 0 && w.size(1) == K / L.elems * L.bytes, "weight rows do not hold K=" + std::to_string(K) + " values");
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M <= kMaxRows, "linear takes at most " + std::to_string(kMaxRows) + " rows; dequantize for more");
  check_weight(w, type, K);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldw = w.stride(0);
  // At least ~256k weights per thread: a smaller matrix runs on one thread, as waking the others costs more than
  // it saves (and much more on a loaded machine, where a parallel region waits for every thread to be scheduled).
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 18) / K);
  dispatch(type, [&](auto t) {
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> tile(kTile * K, 0.f);  // zeroed: a short last tile reads finite stale rows
      linear_range<decltype(t)::value>(xp, M, K, wp, ldw, op, N, begin, end, tile.data());
    });
  });
  return out;
}

torch::Tensor dequantize(const torch::Tensor& w, int64_t type, int64_t K) {
  check_weight(w, type, K);
  const int64_t R = w.size(0);
  auto out = torch::empty({R, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldw = w.stride(0);
  dispatch(type, [&](auto t) {
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      dequant_rows<decltype(t)::value>(wp, ldw, op, K, begin, end);
    });
  });
  return out;
}

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "none";
#endif
}

}  // namespace peregrine_quant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &peregrine_quant::linear, "x[M<=16, K] float32 @ quantized W[N, K]^T -> float32 [M, N]");
  m.def("dequantize", &peregrine_quant::dequantize, "quantized rows [R, bytes] -> float32 [R, K]");
  m.def("isa", &peregrine_quant::isa, "the ISA level this module was compiled for");
  m.attr("max_rows") = peregrine_quant::kMaxRows;
}
