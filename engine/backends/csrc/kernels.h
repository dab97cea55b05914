// Peregrine's CPU kernels: what the kernel families share (built by engine/backends/cpu_kernels.py, one .so per ISA level).
//
// The families, one file each: linear.cpp (small-batch linear), attention.cpp (paged decode attention),
// norms.cpp (residual add + RMSNorm), amx.cpp (AMX tiles for the decoder's bf16 matmuls), decoder.cpp (a whole
// decode step in one call), sampling.cpp (argmax) and bindings.cpp (the Python module). They are written once over
// vec.h's `Vec`, for float32 and bfloat16 (computed in float32); the AVX512-BF16 dot products (linear.cpp) and
// the AMX tiles (amx.cpp) stay ISA-specific, behind #if on the compiler's feature macros.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace peregrine {

constexpr int64_t kStep = 32;  // the linear's K must be a multiple of this (a 512-bit register of bf16)

// The vector instruction set this module was compiled for: "avx512", "avx2", "neon" or "scalar" (vec.h).
const char* isa();

// --- linear.cpp ---
// out[:, n_begin:n_end] for `rows` (1-8) input rows against weights [N, K] (+ float32 bias), T float or bf16.
template <typename T>
void gemv_rows(int64_t rows, const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldx, int64_t ldo,
               int64_t n_begin, int64_t n_end);
// The same for any number of input rows M: up to 8 at a time, over the weight rows in chunks that stay in L2.
template <typename T>
void gemv_many(int64_t M, const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldx, int64_t ldo,
               int64_t n_begin, int64_t n_end);
torch::Tensor linear_small(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);

// --- qlinear.cpp: x @ W^T for W kept quantized (GGUF blocks), int8 dot products (qdot.h); float32 out ---
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                      const c10::optional<torch::Tensor>& bias);
// This build and CPU have AMX-INT8 and Linux lets the process use the tiles (qdot_lanes.h).
bool amx_int8_available();
// qlinear with the tiled Q4_0 / Q4_1 / Q8_0 forms on AMX int8 tiles from 9 rows (qdot_lanes.h; the same bits)
torch::Tensor qlinear_amx(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                          const c10::optional<torch::Tensor>& bias);
int64_t tile_rows();

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
                                     const torch::Tensor& lengths, int64_t block_size, double scale, double softcap);

// --- amx.cpp (a stub that says "no AMX" where the build has no AMX flags) ---
constexpr int64_t kAheadBytes = 16384;  // software prefetch distance in the packed weight stream

// This build has AMX, the CPU has AMX-BF16 and Linux lets the process use it.
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
