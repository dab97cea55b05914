// qdot.h's weight formats: each GGUF format's block scales and minimums, and its 32 weights of a group decoded to
// int8 (AVX2 registers, or a portable array), plus the u8 x s8 dot product they are multiplied with.
#pragma once

#include "qdot_act.h"

namespace peregrine_quant {

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

inline constexpr bool is_signed(int T) { return T == kQ8_0 || T == kQ6_K; }
// Formats with a scale per 32 values, whose scales the AVX2 dot reads from the block as it goes (elsewhere, and for
// Q6_K, a row's scales are read into an array first). Q4_0 / Q4_1 / Q8_0 rows (packed) and Q4_K rows go through
// `dot_packed` instead.
#if defined(__AVX2__)
inline constexpr bool scales_inline(int T) { return layout_of(T).elems == 32; }
#else
inline constexpr bool scales_inline(int) { return false; }
#endif
inline constexpr bool has_min(int T) { return !is_signed(T); }
// The most activation rows for which a row's weights are decoded in registers for each group of up to four rows;
// past it (always, for Q6_K) they are decoded once into a buffer.
inline constexpr int64_t fused_rows_max(int T) { return T == kQ6_K ? 0 : INT64_MAX; }

// A block's float scales, per 32 values one at sc2[2g] (and for Q6_K, which has a scale per 16 values, a second
// one at sc2[2g + 1]: values 0-15 and 16-31), and for unsigned formats the minimum that multiplies the activation
// group's sum. The f16 pair of Q4_1 (d, m) is converted by one instruction where the CPU has F16C.
template <int T>
inline void scales_block(const uint8_t* b, float* sc2, float* mins);
#if defined(__F16C__)
inline __m128 halves4(const uint8_t* b) {  // the two f16 at b (and two more), as float32
  int32_t bits;
  std::memcpy(&bits, b, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}
#endif
template <>
inline void scales_block<kQ8_0>(const uint8_t* b, float* sc2, float*) {
  sc2[0] = half_to_float(b);
}
// f16 d with a fixed offset o (Q4_0: 8, Q5_0: 16): d * (q - o) = d * q - o * d.
inline void scales_offset(const uint8_t* b, float offset, float* sc2, float* mins) {
  const float d = half_to_float(b);
  sc2[0] = d;
  mins[0] = -offset * d;
}
// f16 d and m (Q4_1, Q5_1): d * q + m.
inline void scales_dm(const uint8_t* b, float* sc2, float* mins) {
#if defined(__F16C__)
  const __m128 dm = halves4(b);
  _mm_store_ss(sc2, dm);
  _mm_store_ss(mins, _mm_movehdup_ps(dm));
#else
  sc2[0] = half_to_float(b);
  mins[0] = half_to_float(b + 2);
#endif
}
template <>
inline void scales_block<kQ4_0>(const uint8_t* b, float* sc2, float* mins) { scales_offset(b, 8.f, sc2, mins); }
template <>
inline void scales_block<kQ5_0>(const uint8_t* b, float* sc2, float* mins) { scales_offset(b, 16.f, sc2, mins); }
template <>
inline void scales_block<kQ4_1>(const uint8_t* b, float* sc2, float* mins) { scales_dm(b, sc2, mins); }
template <>
inline void scales_block<kQ5_1>(const uint8_t* b, float* sc2, float* mins) { scales_dm(b, sc2, mins); }
// Q4_K: a block's eight group scales d * sc and minimums -dmin * mn, contiguous (the packed path's layout).
inline void scales8_q4k(const uint8_t* b, float* sc8, float* mins8) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
#if defined(__AVX2__)
  uint32_t u[4];  // the 6-bit scales and minimums unpacked into bytes at once (ggml's bit trick)
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
  const uint32_t mins_low = u[1] & k6;
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  u[2] = mins_low;
  u[0] &= k6;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));  // scales 0-7, minimums 0-7
  _mm256_storeu_ps(sc8, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))));
  _mm256_storeu_ps(mins8, _mm256_mul_ps(_mm256_set1_ps(-dmin),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))));
#else
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    sc8[j] = d * sc;
    mins8[j] = -dmin * mn;
  }
#endif
}
template <>
inline void scales_block<kQ6_K>(const uint8_t* b, float* sc2, float*) {  // 16 scales, one per 16 values, in order
  const float d = half_to_float(b + 208);
  for (int i = 0; i < 16; ++i) sc2[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
}

// The 32 weights of group j (values 32j .. 32j + 31) of block b: signed for Q8_0 and Q6_K, 0..15 otherwise.
#if defined(__AVX2__)
using W32 = __m256i;
template <int T>
inline W32 weights32(const uint8_t* b, int j);
template <>
inline W32 weights32<kQ8_0>(const uint8_t* b, int) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
}
template <>
inline W32 weights32<kQ4_0>(const uint8_t* b, int) { return nibbles16(b + 2); }
template <>
inline W32 weights32<kQ4_1>(const uint8_t* b, int) { return nibbles16(b + 4); }
// 32 fifth bits (a little-endian word) as 0x10 in the bytes whose bit is set (ggml's bytes_from_bits_32).
inline __m256i fifths32(const uint8_t* p) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(fifth_bits(p))),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}
template <>
inline W32 weights32<kQ5_0>(const uint8_t* b, int) { return _mm256_or_si256(nibbles16(b + 6), fifths32(b + 2)); }
template <>
inline W32 weights32<kQ5_1>(const uint8_t* b, int) { return _mm256_or_si256(nibbles16(b + 8), fifths32(b + 4)); }
template <>
inline W32 weights32<kQ6_K>(const uint8_t* b, int j) {  // half n = j / 4, group g = j % 4 of it
  const int n = j / 4, g = j % 4;
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32 * (g % 2)));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
  const __m256i low = _mm256_and_si256(g / 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0xF));
  const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g), _mm256_set1_epi8(3)), 4);
  return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
}
inline W32 load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(int8_t* p, W32 w) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w); }
#else
struct W32 {
  int8_t v[32];
};
template <int T>
inline W32 weights32(const uint8_t* b, int j) {
  W32 w;
  for (int l = 0; l < 32; ++l) {
    if constexpr (T == kQ8_0) {
      w.v[l] = static_cast<int8_t>(b[2 + l]);
    } else if constexpr (T == kQ4_0 || T == kQ4_1) {
      const uint8_t q = b[(T == kQ4_0 ? 2 : 4) + l % 16];
      w.v[l] = static_cast<int8_t>(l < 16 ? q & 0xF : q >> 4);
    } else if constexpr (T == kQ5_0 || T == kQ5_1) {
      const uint8_t q = b[(T == kQ5_0 ? 6 : 8) + l % 16];
      const uint32_t h = fifth_bits(b + (T == kQ5_0 ? 2 : 4));
      w.v[l] = static_cast<int8_t>((l < 16 ? q & 0xF : q >> 4) | (((h >> l) & 1) << 4));
    } else {  // Q6_K
      const int n = j / 4, g = j % 4;
      const uint8_t low = (b[64 * n + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0xF,
                    high = (b[128 + 32 * n + l] >> (2 * g)) & 3;
      w.v[l] = static_cast<int8_t>((low | (high << 4)) - 32);
    }
  }
  return w;
}
inline W32 load32(const int8_t* p) {
  W32 w;
  std::memcpy(w.v, p, 32);
  return w;
}
inline void store32(int8_t* p, const W32& w) { std::memcpy(p, w.v, 32); }
#endif

#if defined(__AVX2__)
// Unsigned weights times signed activations, 32 pairs: u8 x s8 pairs into int16 (at most 2 * 128 * 127, no
// saturation), then pairs of those into int32; lane i holds values 4i .. 4i + 3.
inline __m256i dot_u8s8(__m256i w, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);  // the same sums, in one instruction
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, a);  // AVX-VNNI's (VEX) encoding of it
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}

inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}
#endif

}  // namespace peregrine_quant
