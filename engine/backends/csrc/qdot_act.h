// qdot.h's activations: a step's input rows quantized to int8 in blocks of 32 (one float scale each, as ggml's
// Q8_0 / Q8_1), row by row (a row's blocks depend on that row alone), and the per-thread scratch they live in.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace peregrine_quant {

constexpr int kQK = 32;  // activation block: one float scale per 32 int8 values

// Activation rows quantized in blocks of 32: q = round(x / d), d = max|x| / 127, and s = d * sum(q) (the block's
// sum as the quantized values give it, for formats with a per-block minimum).
struct QRows {
  int8_t* q;  // [rows, K]
  float* d;   // [rows, K / 32]
  float* s;   // [rows, K / 32]
  int64_t K;
};

#if defined(__AVX2__)
// One block of 32 float32 values, as the portable loop below computes it (the same products, the same rounding: the
// conversion rounds to nearest even, as nearbyint does in the default rounding mode).
inline void quantize_block(const float* x, int8_t* q, float* d, float* s) {
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
               v3 = _mm256_loadu_ps(x + 24), sign = _mm256_set1_ps(-0.f);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vi = _mm256_set1_ps(inv);
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vi)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vi));
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
  d[0] = scale;
  s[0] = scale * static_cast<float>(_mm_cvtsi128_si32(u));
}
#endif

template <typename T>
inline void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* s) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t b = 0; b < K / kQK; ++b) quantize_block(x + b * kQK, q + b * kQK, d + b, s + b);
    return;
  }
#endif
  for (int64_t b = 0; b < K / kQK; ++b) {
    float v[kQK], amax = 0.f;
    for (int i = 0; i < kQK; ++i) {
      v[i] = static_cast<float>(x[b * kQK + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < kQK; ++i) {
      const int r = static_cast<int>(std::nearbyint(v[i] * inv));
      q[b * kQK + i] = static_cast<int8_t>(r);
      sum += r;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

// Per-thread buffers: the activations quantized (rows x K), one row's scales and minimums, and (Q6_K with many
// rows) its weights decoded.
struct QScratch {
  std::vector<int8_t> q, w;
  std::vector<float> d, s, sc2, mins, sc;
  QRows rows(int64_t M, int64_t K) {
    if (static_cast<int64_t>(q.size()) < M * K) {
      q.resize(M * K);
      d.resize(M * K / kQK);
      s.resize(M * K / kQK);
    }
    return {q.data(), d.data(), s.data(), K};
  }
  void row_buffers(int64_t K) {
    if (static_cast<int64_t>(w.size()) < K) {
      w.resize(K);
      sc2.resize(K / kQK * 2 + 8);  // (+ 8: the packed path's partial last chunk of 8 groups)
      mins.resize(K / kQK + 8);
      sc.resize((K / kQK + 8) * 4);
    }
  }
};

template <typename X>
inline QRows quantize_rows(const X* x, int64_t ldx, int64_t M, int64_t K, QScratch& s) {
  QRows r = s.rows(M, K);
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, K, r.q + m * K, r.d + m * K / kQK, r.s + m * K / kQK);
  return r;
}

}  // namespace peregrine_quant
