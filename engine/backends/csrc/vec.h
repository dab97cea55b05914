// Peregrine's portable vector layer: one float32 vector type, `Vec`, whose backend the compiler flags pick.
//
//   AVX-512F (-mavx512f ...)   16 lanes     AVX2 + FMA (-mavx2 -mfma -mf16c)   8 lanes
//   NEON (aarch64)              4 lanes     anything else                      1 lane (scalar)
//
// The kernels are written once over it. They load float32 or bfloat16 (widened to float32 in registers), compute
// in float32 and store either. Every operation is a fixed instruction sequence on a given backend, so a kernel's
// result for one row depends only on that row's data, never on how many rows or threads share the call (batch
// invariance); the bits may differ between backends (their reductions sum in different orders).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PEREGRINE_VEC "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PEREGRINE_VEC "avx2"
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define PEREGRINE_VEC "neon"
#else
#define PEREGRINE_VEC "scalar"
#endif

// The build these flags make, as engine/backends/cpu_features.py names its levels' builds: the vector layer's
// width, and which dot products the kernels multiply with (int8: VNNI's `vpdpbusd`, 512 or 256 bits; bf16: BF16's
// `vdpbf16ps`). The module's `isa()`.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define PEREGRINE_BUILD "avx512_bf16"
#elif defined(__AVX512F__) && defined(__AVX512VNNI__)
#define PEREGRINE_BUILD "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define PEREGRINE_BUILD "avx_vnni"
#else
#define PEREGRINE_BUILD PEREGRINE_VEC
#endif

namespace peregrine {

using bf16 = c10::BFloat16;
using f16 = c10::Half;  // a KV cache's element where it is kept in float16 (the decoder's attention reads it)

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }  // into L2 (prefetcht1), not L1

// A spin-wait hint to the core (another hardware thread may use the pipeline meanwhile).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN), as c10::BFloat16 rounds.
inline uint32_t round_bits(uint32_t u) { return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; }

#if defined(__AVX512F__)
struct Vec {
  static constexpr int W = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};  // bf16: float's top half
  }
  static Vec load(const f16* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Vec load(const int8_t* p) {  // an int8 KV cache's values, widened (its row scale applies elsewhere)
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const {
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  bool any_nan() const { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
  bool any_eq(Vec o) const { return _mm512_cmp_ps_mask(v, o.v, _CMP_EQ_OQ) != 0; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
  friend Vec floor(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
  friend Vec abs(Vec a) { return {_mm512_abs_ps(a.v)}; }
  friend Vec select_ge0(Vec c, Vec a, Vec b) {  // c >= 0 ? a : b
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(c.v, _mm512_setzero_ps(), _CMP_GE_OQ), b.v, a.v)};
  }
  friend Vec exp2_int(Vec whole) { return {_mm512_scalef_ps(_mm512_set1_ps(1.f), whole.v)}; }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  static constexpr int W = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  static Vec load(const f16* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static Vec load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const {
    const __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                   _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  float sum() const {  // pairwise: (lo + hi) halves, then within 128 bits
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  bool any_nan() const { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
  bool any_eq(Vec o) const { return _mm256_movemask_ps(_mm256_cmp_ps(v, o.v, _CMP_EQ_OQ)) != 0; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec floor(Vec a) { return {_mm256_floor_ps(a.v)}; }
  friend Vec abs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), a.v)}; }
  friend Vec select_ge0(Vec c, Vec a, Vec b) {
    return {_mm256_blendv_ps(b.v, a.v, _mm256_cmp_ps(c.v, _mm256_setzero_ps(), _CMP_GE_OQ))};
  }
  friend Vec exp2_int(Vec whole) {  // 2^whole for whole an integer in [-126, 127]: the exponent bits
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(whole.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
  }
};
#elif defined(__ARM_NEON) && defined(__aarch64__)
struct Vec {
  static constexpr int W = 4;
  float32x4_t v;
  static Vec zero() { return {vdupq_n_f32(0.f)}; }
  static Vec set1(float x) { return {vdupq_n_f32(x)}; }
  static Vec load(const float* p) { return {vld1q_f32(p)}; }
  static Vec load(const bf16* p) {
    return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16))};
  }
  static Vec load(const f16* p) {
    return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))))};
  }
  static Vec load(const int8_t* p) {
    const float x[4] = {static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
                        static_cast<float>(p[3])};
    return {vld1q_f32(x)};
  }
  void store(float* p) const { vst1q_f32(p, v); }
  void store(bf16* p) const {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
    r = vbslq_u32(vceqq_f32(v, v), r, vdupq_n_u32(0x7fc0));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(r));
  }
  float sum() const { return vaddvq_f32(v); }
  float max() const { return vmaxvq_f32(v); }
  bool any_nan() const { return vminvq_u32(vceqq_f32(v, v)) == 0; }
  bool any_eq(Vec o) const { return vmaxvq_u32(vceqq_f32(v, o.v)) != 0; }
  friend Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
  friend Vec fmadd(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  friend Vec floor(Vec a) { return {vrndmq_f32(a.v)}; }
  friend Vec abs(Vec a) { return {vabsq_f32(a.v)}; }
  friend Vec select_ge0(Vec c, Vec a, Vec b) { return {vbslq_f32(vcgeq_f32(c.v, vdupq_n_f32(0.f)), a.v, b.v)}; }
  friend Vec exp2_int(Vec whole) {
    const int32x4_t e = vaddq_s32(vcvtq_s32_f32(whole.v), vdupq_n_s32(127));
    return {vreinterpretq_f32_s32(vshlq_n_s32(e, 23))};
  }
};
#else
struct Vec {  // one lane: any C++17 compiler
  static constexpr int W = 1;
  float v;
  static Vec zero() { return {0.f}; }
  static Vec set1(float x) { return {x}; }
  static Vec load(const float* p) { return {*p}; }
  static Vec load(const bf16* p) { return {static_cast<float>(*p)}; }
  static Vec load(const f16* p) { return {static_cast<float>(*p)}; }
  static Vec load(const int8_t* p) { return {static_cast<float>(*p)}; }
  void store(float* p) const { *p = v; }
  void store(bf16* p) const { *p = bf16(v); }
  float sum() const { return v; }
  float max() const { return v; }
  bool any_nan() const { return std::isnan(v); }
  bool any_eq(Vec o) const { return v == o.v; }
  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  friend Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
  friend Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
  friend Vec fmadd(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, c.v)}; }
  friend Vec floor(Vec a) { return {std::floor(a.v)}; }
  friend Vec abs(Vec a) { return {std::fabs(a.v)}; }
  friend Vec select_ge0(Vec c, Vec a, Vec b) { return c.v >= 0.f ? a : b; }
  friend Vec exp2_int(Vec whole) { return {std::ldexp(1.f, static_cast<int>(whole.v))}; }
};
#endif

// Values rounded to T's precision (bfloat16: to nearest even), still as float32: what storing to T and loading back
// gives, without the round trip through memory where T is float.
template <typename T>
inline Vec round_to(Vec x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    alignas(64) bf16 tmp[Vec::W];
    x.store(tmp);
    return Vec::load(tmp);
  }
}

// e^x for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^floor * 2^frac, the fraction by its
// Taylor series to degree 8 (relative error about 1e-7, float32's own).
__attribute__((always_inline)) inline Vec exp_nonpositive(Vec x) {
  const Vec t = max(x, Vec::set1(-87.f)) * Vec::set1(1.4426950408889634f);
  const Vec whole = floor(t);
  const Vec f = t - whole;  // [0, 1)
  static constexpr float c[] = {1.f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                                0.009618129107628477f, 0.0013333558146428443f, 0.00015403530393381606f,
                                1.525273380405984e-05f, 1.3215486790144307e-06f};
  Vec p = Vec::set1(c[8]);
  for (int k = 7; k >= 0; --k) p = fmadd(p, f, Vec::set1(c[k]));
  return p * exp2_int(whole);
}

// cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits; cap > 0): tanh(|y|) is
// (1 - e) / (1 + e) with e = exp(-2|y|), through the softmax's exp, the sign put back.
__attribute__((always_inline)) inline Vec soft_cap(Vec x, float cap) {
  const Vec one = Vec::set1(1.f), e = exp_nonpositive(abs(x) * Vec::set1(-2.f / cap));
  const Vec t = Vec::set1(cap) * ((one - e) / (one + e));
  return select_ge0(x, t, Vec::zero() - t);
}

}  // namespace peregrine
