// qdot.h's activations: a step's input rows quantized to int8 in blocks of 32 (one float scale each, as ggml's
// Q8_0 / Q8_1) for the formats with a scale per 32 values, or in blocks of 256 with each 16 values' sum (as ggml's
// Q8_K) for the K-quants, row by row (a row's blocks depend on that row alone), and the per-thread scratch they live
// in.
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

constexpr int kQK = 32;     // activation block: one float scale per 32 int8 values
constexpr int kQK_K = 256;  // the K-quants' super-block, and their activation block (Q8_K)

// The K-quant formats and IQ4_XS (a super-block of 256 values with 6- or 8-bit group scales): multiplied with
// Q8_K-style activations (qdot_kquant.h); tiled Q4_K, Q5_K and Q6_K too.
inline constexpr bool is_kquant(int T) {
  return T == kQ4_K || T == kQ5_K || T == kQ6_K || T == kIQ4_XS || T == kQ4_KT || T == kQ5_KT ||
         T == kQ6_KT;
}

// Activation rows quantized in blocks of 32: q = round(x / d), d = max|x| / 127, and s = d * sum(q) (the block's
// sum as the quantized values give it, for formats with a per-block minimum). For the K-quants, in blocks of 256
// instead (kq, kd, and the int16 sums of each 16 values, ks). Either set may be absent (null): a matmul's callers
// quantize the rows as each weight format needs them (quantize_for). K-quant blocks also keep each 32 values' sum
// as the quantized values give it, times the block's d, in float (ksf: Q4_K's minimums multiply those).
struct QRows {
  int8_t* q;    // [rows, K]
  float* d;     // [rows, K / 32]
  float* s;     // [rows, K / 32]
  int64_t K;
  int8_t* kq;   // [rows, K]
  float* kd;    // [rows, K / 256]
  int16_t* ks;  // [rows, K / 16]
  float* ksf;   // [rows, K / 32]
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

// A block of 256 values as Q8_K: q = round(x * (127 / max|x|)) (the same operations as quantize_row's, in blocks of
// 256), d = max|x| / 127, the sum of each 16 q, and d times the sum of each 32.
inline void quantize_block_k(const float* v, int8_t* q, float* d, int16_t* sums, float* dsums) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < kQK_K; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 vi = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (int c = 0; c < kQK_K / 32; ++c) {
    const float* x = v + 32 * c;
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), vi)),
                  i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), vi)),
                  i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), vi)),
                  i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), vi));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * c),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    // (values 0-15 in i0, i1; 16-31 in i2, i3): the two sums of 16 in lanes 0 and 1
    const __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_hadd_epi32(u, u);
    sums[2 * c] = static_cast<int16_t>(_mm_cvtsi128_si32(u));
    sums[2 * c + 1] = static_cast<int16_t>(_mm_extract_epi32(u, 1));
  }
#else
  float amax = 0.f;
  for (int i = 0; i < kQK_K; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < kQK_K / 16; ++i) {
    int sum = 0;
    for (int l = 0; l < 16; ++l) {
      const int r = static_cast<int>(std::nearbyint(v[16 * i + l] * inv));
      q[16 * i + l] = static_cast<int8_t>(r);
      sum += r;
    }
    sums[i] = static_cast<int16_t>(sum);
  }
#endif
  d[0] = amax / 127.f;
  for (int i = 0; i < kQK_K / 32; ++i) dsums[i] = d[0] * static_cast<float>(sums[2 * i] + sums[2 * i + 1]);
}

template <typename T>
inline void quantize_row_k(const T* x, int64_t K, int8_t* q, float* d, int16_t* sums, float* dsums) {
  for (int64_t b = 0; b < K / kQK_K; ++b) {
    const float* v;
    float f[kQK_K];
    if constexpr (std::is_same_v<T, float>) {
      v = x + b * kQK_K;
    } else {
      for (int i = 0; i < kQK_K; ++i) f[i] = static_cast<float>(x[b * kQK_K + i]);
      v = f;
    }
    quantize_block_k(v, q + b * kQK_K, d + b, sums + b * (kQK_K / 16), dsums + b * (kQK_K / 32));
  }
}

// Per-thread buffers: the activations quantized (rows x K, in either set of blocks), and one weight row's scales and
// minimums (and those scales times each activation row's).
struct QScratch {
  bool amx = false;  // the tiled Q4_0 / Q4_1 / Q8_0 forms may multiply on AMX int8 tiles (qdot_lanes.h: the caller's
                     // AMX decision, where amx_int8_available())
  std::vector<int8_t> q, kq, wq;  // wq: one weight row's values, decoded once for many activation rows
  std::vector<float> d, s, wd, mins, sc, kd, ksf;
  std::vector<int16_t> ks;
  void rows(int64_t M, int64_t K, QRows& r) {
    if (static_cast<int64_t>(q.size()) < M * K) {
      q.resize(M * K);
      d.resize(M * K / kQK);
      s.resize(M * K / kQK);
    }
    r.q = q.data(), r.d = d.data(), r.s = s.data(), r.K = K;
  }
  void rows_k(int64_t M, int64_t K, QRows& r) {
    if (static_cast<int64_t>(kq.size()) < M * K) {
      kq.resize(M * K);
      kd.resize(M * K / kQK_K);
      ks.resize(M * K / 16);
      ksf.resize(M * K / 32);
    }
    r.kq = kq.data(), r.kd = kd.data(), r.ks = ks.data(), r.ksf = ksf.data(), r.K = K;
  }
  void row_buffers(int64_t K) {
    if (static_cast<int64_t>(wd.size()) < K / kQK + 8) {
      wd.resize(K / kQK + 8);  // (+ 8: the packed path's partial last chunk of 8 groups)
      mins.resize(K / kQK + 8);
      sc.resize((K / kQK + 8) * 4);
    }
    if (static_cast<int64_t>(wq.size()) < K) wq.resize(K);
  }
};

// The rows x[:M] quantized into `r` as weights of format `type` need them (blocks of 256 for the K-quants, of 32
// otherwise), unless `r` holds them already: calls on the same x share one QRows (empty at first).
template <typename X>
inline void quantize_for(int type, const X* x, int64_t ldx, int64_t M, int64_t K, QScratch& s, QRows& r) {
  if (is_kquant(type)) {
    if (r.kq) return;
    s.rows_k(M, K, r);
    for (int64_t m = 0; m < M; ++m)
      quantize_row_k(x + m * ldx, K, r.kq + m * K, r.kd + m * K / kQK_K, r.ks + m * K / 16, r.ksf + m * K / 32);
    return;
  }
  if (r.q) return;
  s.rows(M, K, r);
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, K, r.q + m * K, r.d + m * K / kQK, r.s + m * K / kQK);
}

}  // namespace peregrine_quant
