// Peregrine's CPU kernels: what the kernel families share (built by engine/cpu_kernels.py, one .so per ISA level).
//
// The families, one file each: linear.cpp (small-batch linear), attention.cpp (paged decode attention),
// norms.cpp (residual add + RMSNorm), amx.cpp (AMX tiles for the decoder's matmuls), decoder.cpp (a whole decode
// step in one call), sampling.cpp (argmax) and bindings.cpp (the Python module).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace peregrine {

using bf16 = c10::BFloat16;

constexpr int64_t kStep = 32;  // bf16 elements per 512-bit register

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<bf16>(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bf16 is float's top half
}

// e^x for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^floor * 2^frac, the fraction by its
// Taylor series to degree 8 (relative error about 1e-7, float32's own).
__attribute__((always_inline)) inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);  // [0, 1)
  static constexpr float c[] = {1.f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                                0.009618129107628477f, 0.0013333558146428443f, 0.00015403530393381606f,
                                1.525273380405984e-05f, 1.3215486790144307e-06f};
  __m512 p = _mm512_set1_ps(c[8]);
  for (int k = 7; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[k]));
  return _mm512_scalef_ps(p, whole);
}

// --- linear.cpp ---
// out[:, n_begin:n_end] for `rows` (1-8) bf16 input rows against bf16 weights [N, K] (+ float32 bias).
void gemv_rows(int64_t rows, const uint16_t* x, const uint16_t* w, const float* bias, bf16* out, int64_t K,
               int64_t ldx, int64_t ldo, int64_t n_begin, int64_t n_end);
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);

// --- norms.cpp ---
// One row: hr += dr (when given); out = weight * to_T(hr * rsqrt(mean(hr^2) + eps)), statistics in float32.
template <typename T>
void add_rms_norm_row(T* hr, const T* dr, const T* weight, T* out, int64_t hidden, float eps);
torch::Tensor add_rms_norm_(torch::Tensor& h, const c10::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                            double eps);

// --- sampling.cpp ---
torch::Tensor argmax_rows(const torch::Tensor& x);

// --- attention.cpp (the shared pieces in attention.h) ---
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& lengths, int64_t block_size, double scale);

// --- amx.cpp ---
constexpr int64_t kAheadBytes = 16384;  // software prefetch distance in the packed weight stream

// This CPU has AMX-BF16 and Linux lets the process use it.
bool amx_available();
// The weights [N, K] as AMX B tiles, in the order a step reads them (N * K elements at dst).
void pack_weight(const uint16_t* w, int64_t N, int64_t K, uint16_t* dst);
struct AmxScratch {
  alignas(64) float c[1024];
  int64_t tile_rows = 0;  // the pass size the tile configuration holds (0: none loaded)
};
// out[:M, n_begin:n_end] = x[:M] @ w[n_begin:n_end]^T (+ bias) from the packed weights; n_begin a multiple of 32,
// n_end one too or N.
void amx_rows(const uint16_t* packed, int64_t N, int64_t K, const float* bias, const uint16_t* xs, int64_t ldx,
              int64_t M, bf16* out, int64_t ldo, int64_t n_begin, int64_t n_end, AmxScratch& s);
void amx_release();  // the thread's tile state, at the end of a step

// --- decoder.cpp ---
void bind_decoder(pybind11::module_& m);

}  // namespace peregrine
