// Integer dot products against GGUF weights kept quantized, the way llama.cpp's vec_dot kernels compute them: a
// decode step's activations are quantized to int8 in blocks of 32 (one float scale each, as ggml's Q8_0/Q8_1),
// each weight row is unpacked once into int8 values and per-16 float scales (L1-sized), and every activation row is
// multiplied with it in int8 (AVX2: `vpmaddubsw` + `vpmaddwd`, 32 products an instruction), scaled and summed in
// float32. Used by the one-call decoder (decoder.cpp) and bound as `qlinear` for tests.
//
// Each output element is the same instruction sequence in the same order whatever the number of rows, the thread
// split or the tile position: results are batch invariant. The unpacking is written once, plainly (the compiler
// vectorizes it for each build); the dot has an AVX2 body (also used by the AVX-512 build) and a portable one.
#pragma once

#include <algorithm>
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

template <typename T>
inline void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* s) {
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

// One weight row unpacked: int8 values (signed; Q4_1 and Q4_K's nibbles 0..15), per 32 values two float scales
// (values 0-15 and 16-31: they differ for Q6_K only, which has a scale per 16) and, for formats with a minimum,
// the term that multiplies the activation block's sum.
struct Unpacked {
  int8_t* w;    // [K]
  float* sc2;   // [K / 32 * 2]
  float* mins;  // [K / 32]
  bool has_min;
};

inline void put_scales(float* sc2, float lo, float hi) {
  sc2[0] = lo;
  sc2[1] = hi;
}

#if defined(__AVX2__)
// a * b + c; fused where the build has FMA (the AVX2 build; the AVX-512 build's flags do not imply it).
inline __m256 madd8(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

// 16 bytes of nibbles as 32 values: the low nibbles, then the high ones (ggml's Q4_0 / Q4_1 order).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
}
#endif

template <int T>
inline void unpack_block(const uint8_t* b, int8_t* __restrict w, float* sc2, float* mins);

template <>
inline void unpack_block<kQ8_0>(const uint8_t* b, int8_t* __restrict w, float* sc2, float*) {
  const float d = half_to_float(b);
  std::memcpy(w, b + 2, 32);
  put_scales(sc2, d, d);
}

template <>
inline void unpack_block<kQ4_0>(const uint8_t* b, int8_t* __restrict w, float* sc2, float*) {
#if defined(__AVX2__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)));
#else
  uint8_t q[16];
  std::memcpy(q, b + 2, 16);
  for (int i = 0; i < 16; ++i) {
    w[i] = static_cast<int8_t>((q[i] & 0xF) - 8);
    w[i + 16] = static_cast<int8_t>((q[i] >> 4) - 8);
  }
#endif
  const float d = half_to_float(b);
  put_scales(sc2, d, d);
}

template <>
inline void unpack_block<kQ4_1>(const uint8_t* b, int8_t* __restrict w, float* sc2, float* mins) {
#if defined(__AVX2__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), nibbles16(b + 4));
#else
  uint8_t q[16];
  std::memcpy(q, b + 4, 16);
  for (int i = 0; i < 16; ++i) {
    w[i] = static_cast<int8_t>(q[i] & 0xF);
    w[i + 16] = static_cast<int8_t>(q[i] >> 4);
  }
#endif
  const float d = half_to_float(b);
  put_scales(sc2, d, d);
  mins[0] = half_to_float(b + 2);
}

template <>
inline void unpack_block<kQ4_K>(const uint8_t* b, int8_t* __restrict w, float* sc2, float* mins) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  uint8_t qs[128];
  std::memcpy(qs, b + 16, 128);
  for (int j = 0; j < 4; ++j) {  // 64 values: 32 low nibbles (sub-block 2j), then 32 high (2j + 1)
#if defined(__AVX2__)
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j)), m4 = _mm256_set1_epi8(0xF);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 64 * j), _mm256_and_si256(q, m4));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
#else
    for (int l = 0; l < 32; ++l) {
      w[64 * j + l] = static_cast<int8_t>(qs[32 * j + l] & 0xF);
      w[64 * j + 32 + l] = static_cast<int8_t>(qs[32 * j + l] >> 4);
    }
#endif
    for (int h = 0; h < 2; ++h) {
      uint8_t sc, mn;
      scale_min_k4(2 * j + h, b + 4, &sc, &mn);
      put_scales(sc2 + 2 * (2 * j + h), d * sc, d * sc);
      mins[2 * j + h] = -dmin * mn;
    }
  }
}

template <>
inline void unpack_block<kQ6_K>(const uint8_t* b, int8_t* __restrict w, float* sc2, float*) {
  uint8_t raw[208];
  std::memcpy(raw, b, 208);
  const float d = half_to_float(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(raw + 192);
  for (int n = 0; n < 2; ++n) {  // 128 values: ql[64n .. 64n + 64), qh[32n .. 32n + 32)
    const uint8_t *ql = raw + 64 * n, *qh = raw + 128 + 32 * n;
    int8_t* y = w + 128 * n;
#if defined(__AVX2__)
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql)),
                  l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32)),
                  h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)), m4 = _mm256_set1_epi8(0xF),
                  m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    auto six = [&](__m256i low, int shift) {  // low 4 bits | 2 bits of qh from `shift`, minus 32
      const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift), m2), 4);
      return _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(low, m4), high), off);
    };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), six(l0, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 32), six(l1, 2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 64), six(_mm256_srli_epi16(l0, 4), 4));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 96), six(_mm256_srli_epi16(l1, 4), 6));
#else
    for (int l = 0; l < 32; ++l) {
      y[l] = static_cast<int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
      y[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
      y[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      y[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
#endif
    for (int g = 0; g < 4; ++g)  // values 32g .. 32g + 32 of this half: scales sc[8n + 2g] and sc[8n + 2g + 1]
      put_scales(sc2 + 2 * (4 * n + g), d * sc[8 * n + 2 * g], d * sc[8 * n + 2 * g + 1]);
  }
}

template <int T>
inline void unpack_row(const uint8_t* row, int64_t K, const Unpacked& u) {
  constexpr Layout L = layout_of(T);
  constexpr int subs = L.elems / kQK;
  for (int64_t b = 0; b < K / L.elems; ++b)
    unpack_block<T>(row + b * L.bytes, u.w + b * L.elems, u.sc2 + b * subs * 2, u.mins + b * subs);
}

inline constexpr bool has_min(int type) { return type == kQ4_1 || type == kQ4_K; }

// sum_k w[k] * x[k] for one unpacked weight row and one quantized activation row. Two accumulators (even and odd
// blocks) keep two FMA chains in flight; the order of the sums is fixed.
template <bool kTwoScales>
inline float dot_row(const Unpacked& u, const int8_t* q, const float* d, const float* s, int64_t K) {
  const int64_t blocks = K / kQK;
  float total;
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  auto block = [&](int64_t g, __m256 acc) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.w + g * kQK));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kQK));
    // |w| (unsigned) times a with w's sign: u8 x s8 pairs into int16 (at most 2 * 128 * 127, no saturation),
    // then pairs of those into int32: lane i holds values 4i .. 4i + 3.
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)), ones);
    __m256 scale;
    if constexpr (kTwoScales)
      scale = _mm256_set_m128(_mm_set1_ps(u.sc2[2 * g + 1] * d[g]), _mm_set1_ps(u.sc2[2 * g] * d[g]));
    else
      scale = _mm256_set1_ps(u.sc2[2 * g] * d[g]);
    return madd8(_mm256_cvtepi32_ps(p), scale, acc);
  };
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 1 < blocks; g += 2) {
    acc0 = block(g, acc0);
    acc1 = block(g + 1, acc1);
  }
  if (g < blocks) acc0 = block(g, acc0);
  const __m256 acc[2] = {acc0, acc1};
  const __m256 both = _mm256_add_ps(acc[0], acc[1]);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  total = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
#else
  float lanes[2][8] = {};
  for (int64_t g = 0; g < blocks; ++g) {
    const int8_t *w = u.w + g * kQK, *a = q + g * kQK;
    for (int lane = 0; lane < 8; ++lane) {
      int32_t p = 0;
      for (int i = 0; i < 4; ++i) p += static_cast<int32_t>(w[4 * lane + i]) * a[4 * lane + i];
      lanes[g & 1][lane] += static_cast<float>(p) * (u.sc2[2 * g + (kTwoScales && lane >= 4)] * d[g]);
    }
  }
  float l[8];
  for (int i = 0; i < 8; ++i) l[i] = lanes[0][i] + lanes[1][i];
  total = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
#endif
  if (u.has_min) {  // sum_g mins[g] * s[g], eight lanes at a time, the rest in order
    int64_t g = 0;
#if defined(__AVX2__)
    __m256 m = _mm256_setzero_ps();
    for (; g + 8 <= blocks; g += 8) m = madd8(_mm256_loadu_ps(u.mins + g), _mm256_loadu_ps(s + g), m);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    total += _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
#endif
    for (; g < blocks; ++g) total += u.mins[g] * s[g];
  }
  return total;
}

// Per-thread buffers: the activations quantized (rows x K) and one unpacked weight row.
struct QScratch {
  std::vector<int8_t> q, w;
  std::vector<float> d, s, sc2, mins;
  QRows rows(int64_t M, int64_t K) {
    if (static_cast<int64_t>(q.size()) < M * K) {
      q.resize(M * K);
      d.resize(M * K / kQK);
      s.resize(M * K / kQK);
    }
    return {q.data(), d.data(), s.data(), K};
  }
  Unpacked unpacked(int64_t K, bool with_min) {
    if (static_cast<int64_t>(w.size()) < K) {
      w.resize(K);
      sc2.resize(K / kQK * 2);
      mins.resize(K / kQK);
    }
    return {w.data(), sc2.data(), mins.data(), with_min};
  }
};

template <typename X>
inline QRows quantize_rows(const X* x, int64_t ldx, int64_t M, int64_t K, QScratch& s) {
  QRows r = s.rows(M, K);
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, K, r.q + m * K, r.d + m * K / kQK, r.s + m * K / kQK);
  return r;
}

// out[m * ldo + n] = x[m] . W[n] (+ bias[n]) for n in [n_begin, n_end), m < M; W's rows of blocks `ldw` bytes apart.
template <int T, typename O>
void qlinear_range(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                   int64_t n_begin, int64_t n_end, QScratch& s) {
  const int64_t K = x.K, kb = K / kQK;
  const Unpacked u = s.unpacked(K, has_min(T));
  for (int64_t n = n_begin; n < n_end; ++n) {
    unpack_row<T>(w + n * ldw, K, u);
    const float b = bias ? bias[n] : 0.f;
    for (int64_t m = 0; m < M; ++m)
      out[m * ldo + n] = static_cast<O>(dot_row<T == kQ6_K>(u, x.q + m * K, x.d + m * kb, x.s + m * kb, K) + b);
  }
}

template <typename O>
void qlinear_rows(int type, const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                  int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  switch (type) {
    case kQ4_0: return qlinear_range<kQ4_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_1: return qlinear_range<kQ4_1>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ8_0: return qlinear_range<kQ8_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_K: return qlinear_range<kQ4_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ6_K: return qlinear_range<kQ6_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    default: return;  // the callers check the type first (supported())
  }
}

inline bool supported(int64_t type) { return layout_of(static_cast<int>(type)).elems > 0; }

// One row of an embedding table kept quantized, as float32.
inline void dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  auto rows = [&](auto t) {
    constexpr int F = decltype(t)::value;
    constexpr Layout L = layout_of(F);
    for (int64_t b = 0; b < K / L.elems; ++b) dequant_block<F>(row + b * L.bytes, out + b * L.elems);
  };
  switch (type) {
    case kQ4_0: return rows(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return rows(std::integral_constant<int, kQ4_1>{});
    case kQ8_0: return rows(std::integral_constant<int, kQ8_0>{});
    case kQ4_K: return rows(std::integral_constant<int, kQ4_K>{});
    case kQ6_K: return rows(std::integral_constant<int, kQ6_K>{});
    default: return;
  }
}

}  // namespace peregrine_quant
