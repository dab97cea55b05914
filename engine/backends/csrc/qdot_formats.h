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

inline constexpr bool is_signed(int T) { return T == kQ8_0 || T == kIQ4_NL; }
// Formats whose scales the AVX2 dot reads from the block as it goes (elsewhere a row's scales are read into an array
// first): all of those dot_rows takes, a scale per 32 values. Q4_0 / Q4_1 / Q8_0 rows (packed) go through
// `dot_packed` instead, and the K-quants through qdot_kquant.h.
#if defined(__AVX2__)
inline constexpr bool scales_inline(int T) { return layout_of(T).elems == 32; }
#else
inline constexpr bool scales_inline(int) { return false; }
#endif
inline constexpr bool has_min(int T) { return !is_signed(T); }

// A block's float scale (its 32 values'), and for unsigned formats the minimum that multiplies the activation group's
// sum. The f16 pair of Q4_1 (d, m) is converted by one instruction where the CPU has F16C.
template <int T>
inline void scales_block(const uint8_t* b, float* scale, float* mins);
#if defined(__F16C__)
inline __m128 halves4(const uint8_t* b) {  // the two f16 at b (and two more), as float32
  int32_t bits;
  std::memcpy(&bits, b, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}
#endif
template <>
inline void scales_block<kQ8_0>(const uint8_t* b, float* scale, float*) {
  scale[0] = half_to_float(b);
}
template <>
inline void scales_block<kIQ4_NL>(const uint8_t* b, float* scale, float*) {
  scale[0] = half_to_float(b);
}
// f16 d with a fixed offset o (Q4_0: 8, Q5_0: 16): d * (q - o) = d * q - o * d.
inline void scales_offset(const uint8_t* b, float offset, float* scale, float* mins) {
  const float d = half_to_float(b);
  scale[0] = d;
  mins[0] = -offset * d;
}
// f16 d and m (Q4_1, Q5_1): d * q + m.
inline void scales_dm(const uint8_t* b, float* scale, float* mins) {
#if defined(__F16C__)
  const __m128 dm = halves4(b);
  _mm_store_ss(scale, dm);
  _mm_store_ss(mins, _mm_movehdup_ps(dm));
#else
  scale[0] = half_to_float(b);
  mins[0] = half_to_float(b + 2);
#endif
}
template <>
inline void scales_block<kQ4_0>(const uint8_t* b, float* scale, float* mins) { scales_offset(b, 8.f, scale, mins); }
template <>
inline void scales_block<kQ5_0>(const uint8_t* b, float* scale, float* mins) { scales_offset(b, 16.f, scale, mins); }
template <>
inline void scales_block<kQ4_1>(const uint8_t* b, float* scale, float* mins) { scales_dm(b, scale, mins); }
template <>
inline void scales_block<kQ5_1>(const uint8_t* b, float* scale, float* mins) { scales_dm(b, scale, mins); }
// The 32 weights of block b: signed for Q8_0 and IQ4_NL (its table's values, -127..113), 0..15 (0..31 for Q5_0 /
// Q5_1) otherwise.
#if defined(__AVX2__)
using W32 = __m256i;
template <int T>
inline W32 weights32(const uint8_t* b);
template <>
inline W32 weights32<kQ8_0>(const uint8_t* b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
}
template <>
inline W32 weights32<kQ4_0>(const uint8_t* b) { return nibbles16(b + 2); }
template <>
inline W32 weights32<kQ4_1>(const uint8_t* b) { return nibbles16(b + 4); }
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
inline W32 weights32<kQ5_0>(const uint8_t* b) { return _mm256_or_si256(nibbles16(b + 6), fifths32(b + 2)); }
template <>
inline W32 weights32<kQ5_1>(const uint8_t* b) { return _mm256_or_si256(nibbles16(b + 8), fifths32(b + 4)); }
// IQ4's 16-value table in both lanes: `vpshufb` with it turns 32 nibbles into their int8 values at once.
inline __m256i iq4_table() {
  return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4)));
}
template <>
inline W32 weights32<kIQ4_NL>(const uint8_t* b) { return _mm256_shuffle_epi8(iq4_table(), nibbles16(b + 2)); }
#else
struct W32 {
  int8_t v[32];
};
template <int T>
inline W32 weights32(const uint8_t* b) {
  W32 w;
  for (int l = 0; l < 32; ++l) {
    if constexpr (T == kQ8_0) {
      w.v[l] = static_cast<int8_t>(b[2 + l]);
    } else if constexpr (T == kIQ4_NL) {
      const uint8_t q = b[2 + l % 16];
      w.v[l] = kIQ4[l < 16 ? q & 0xF : q >> 4];
    } else if constexpr (T == kQ4_0 || T == kQ4_1) {
      const uint8_t q = b[(T == kQ4_0 ? 2 : 4) + l % 16];
      w.v[l] = static_cast<int8_t>(l < 16 ? q & 0xF : q >> 4);
    } else {  // Q5_0 / Q5_1
      const uint8_t q = b[(T == kQ5_0 ? 6 : 8) + l % 16];
      const uint32_t h = fifth_bits(b + (T == kQ5_0 ? 2 : 4));
      w.v[l] = static_cast<int8_t>((l < 16 ? q & 0xF : q >> 4) | (((h >> l) & 1) << 4));
    }
  }
  return w;
}
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
