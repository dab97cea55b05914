// Integer dot products against GGUF weights kept quantized, the way llama.cpp's vec_dot kernels compute them: a
// decode step's activations are quantized to int8 in blocks of 32 (one float scale each, as ggml's Q8_0/Q8_1),
// and each weight row is multiplied with them in int8 (AVX2: `vpmaddubsw` + `vpmaddwd`, 32 products an
// instruction), scaled and summed in float32. Used by the one-call decoder (decoder.cpp) and bound as `qlinear`.
//
// A row's weights are decoded in registers, 32 at a time, and each decoded group is multiplied with up to four
// activation rows before the next is decoded. Q6_K is decoded once per row into an L1 buffer instead, a block at a
// time with its groups unrolled (constant shifts, shared loads: 2.3x faster than decoding it group by group in
// the dot, at one row). The AVX2 body reads a 32-value block's scale from the block as it goes; other
// formats and builds read a row's scales into a small float array first. 4-bit weights stay unsigned (Q4_0's
// offset of 8 becomes a minimum, as Q4_1's), so `vpmaddubsw` takes them as they are; signed ones (Q8_0, Q6_K) go
// through the sign trick. The next rows are prefetched: one step streams every weight once.
//
// Q4_0, Q4_1 and Q8_0 are packed by rows at load (quant.h: kQ4_0R / kQ4_1R / kQ8_0R): one 32-byte load gives 64
// 4-bit weights (a 64-byte load 64 8-bit ones), and a row's scales are converted eight at a time and multiplied with
// each activation row's in one pass, so the loop over groups is loads, two shifts/masks and the int8 dot
// (`dot_packed`). Its sums are those of the file's layout, except packed Q8_0's in the AVX-512 build (kUnsignedQ8).
// Q4_K's nibbles are already laid out that way inside each block, so Q4_K rows go through the same loop as they
// are in the file (its scales unpacked a block, 8 groups, at a time). With one to three activation rows (a decode
// step of one to three requests), four weight rows go through that loop together, their scales converted in
// registers eight groups at a time (`qlinear_few_packed`): the same sums, with four rows' independent chains in
// flight instead of one row's prologue, loop and reductions one after the other (1.45x at one row on AVX-512).
//
// Each output element is the same instruction sequence in the same order whatever the number of rows, the thread
// split or the tile position: results are batch invariant. Decoding has an AVX2 body (also used by the AVX-512
// build, which multiplies with AVX-512 VNNI's `vpdpbusd`: the same integer sums) and a portable one, and so has the
// dot.
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

// FMA chains a row in the int8 dot loops (dot_rows, dot_packed). Four on AVX-512 builds, where a pair of groups
// takes one FMA and one chain's latency bounds a row at one activation row (one thread, L2-resident packed Q4_1
// rows, AMD EPYC Zen 5: 28.7-29.4 against 33.1 ns a row at K = 1536, 100-107 against 120-122 at K = 4608, the same
// at K = 576). Two elsewhere: the AVX2 loop has more instructions a pair, and four chains only added work there
// (18.3-18.9 against 16.5-17.3 ns a row at K = 576, same CPU).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)  // dot_packed's 512-bit loop
constexpr int kAccs = 4;
#else
constexpr int kAccs = 2;
#endif

#if defined(__AVX2__)
// Lanes [0, n) of eight set (n <= 8): the mask of a last, partial chunk of eight groups.
inline __m256i lanes_below(int64_t n) {
  static const int32_t table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table + 8 - n));
}
// sum_g mins[g] * s[g] over g < n, eight lanes at a time (a partial last chunk read masked: nothing past n).
inline float mins_dot(const float* mins, const float* s, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= n; g += 8) acc = madd8(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(s + g), acc);
  if (g < n) {
    const __m256i mask = lanes_below(n - g);
    acc = madd8(_mm256_maskload_ps(mins + g, mask), _mm256_maskload_ps(s + g, mask), acc);
  }
  return hsum8(acc);
}
#endif

// res[r] += sum_g mins[g] * s[g] for activation row m0 + r (a weight row's per-group minimums times the activation
// groups' sums): eight lanes at a time with AVX2, in order elsewhere.
template <int R>
inline void add_mins(const float* mins, const QRows& x, int64_t m0, float* res) {
  const int64_t blocks = x.K / kQK;
  for (int r = 0; r < R; ++r) {
    const float* s = x.s + (m0 + r) * blocks;
#if defined(__AVX2__)
    res[r] += mins_dot(mins, s, blocks);
#else
    for (int64_t g = 0; g < blocks; ++g) res[r] += mins[g] * s[g];
#endif
  }
}

// res[r] = sum_k w[k] * x[m0 + r][k] for r < R, one weight row (its blocks at `row`) given group by group by
// `wsrc(g)`. Its scales and minimums are in sc2 / mins already, except where `scales_inline(T)`: then each group's
// scale is read from its block here, and its minimum written to mins[g] for the sum at the end. kAccs accumulators
// a row (group g into the (g mod kAccs)th) keep that many FMA chains in flight, summed as acc0 + acc1, or with four
// as (acc0 + acc2) + (acc1 + acc3); the order of the sums is fixed, whatever R.
template <int T, int R, typename Src>
inline void dot_rows(const Src& wsrc, const uint8_t* row, const float* sc2, float* mins, const QRows& x, int64_t m0,
                     float* res) {
  const int64_t K = x.K, blocks = K / kQK;
#if defined(__AVX2__)
  __m256 acc[kAccs][R];
  for (int j = 0; j < kAccs; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  auto group = [&](int64_t g, __m256* acc) {
    const __m256i w = wsrc(g), wu = is_signed(T) ? _mm256_sign_epi8(w, w) : w;  // |w| for the signed formats
    float sw;  // the group's (first) scale
    if constexpr (scales_inline(T))
      scales_block<T>(row + g * layout_of(T).bytes, &sw, mins + g);
    else
      sw = sc2[2 * g];
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + m * K + g * kQK));
      const __m256i p = dot_u8s8(wu, is_signed(T) ? _mm256_sign_epi8(a, w) : a);  // |w| times a with w's sign
      const float da = x.d[m * blocks + g];
      const __m256 scale = T == kQ6_K ? _mm256_set_m128(_mm_set1_ps(sc2[2 * g + 1] * da), _mm_set1_ps(sw * da))
                                      : _mm256_set1_ps(sw * da);
      acc[r] = madd8(_mm256_cvtepi32_ps(p), scale, acc[r]);
    }
  };
  int64_t g = 0;
  for (; g + kAccs <= blocks; g += kAccs)
    for (int j = 0; j < kAccs; ++j) group(g + j, acc[j]);
  for (int j = 0; g < blocks; ++g, ++j) group(g, acc[j]);
  for (int r = 0; r < R; ++r)
    res[r] = hsum8(kAccs == 4 ? _mm256_add_ps(_mm256_add_ps(acc[0][r], acc[2][r]), _mm256_add_ps(acc[1][r], acc[3][r]))
                              : _mm256_add_ps(acc[0][r], acc[1][r]));
#else
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float lanes[2][8] = {};
    for (int64_t g = 0; g < blocks; ++g) {
      const W32 w = wsrc(g);
      const int8_t* a = x.q + m * K + g * kQK;
      const float da = x.d[m * blocks + g], lo = sc2[2 * g] * da, hi = sc2[2 * g + (T == kQ6_K)] * da;
      for (int lane = 0; lane < 8; ++lane) {
        int32_t p = 0;
        for (int i = 0; i < 4; ++i) p += static_cast<int32_t>(w.v[4 * lane + i]) * a[4 * lane + i];
        lanes[g & 1][lane] += static_cast<float>(p) * (lane < 4 ? lo : hi);
      }
    }
    float l[8];
    for (int i = 0; i < 8; ++i) l[i] = lanes[0][i] + lanes[1][i];
    res[r] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  }
#endif
  if constexpr (has_min(T)) add_mins<R>(mins, x, m0, res);
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

// How many rows ahead of the one multiplied are prefetched: 4, and with few activation rows (where a step streams
// the weights as fast as memory gives them) at least 4 KiB ahead, 8 KiB at one row, so short rows (a Q4_1 row of
// 576 weights is 360 bytes) keep enough lines in flight to cover the memory's latency. A thread's share of a matmul
// starts with its first `ahead` rows requested at once (prefetch_first), not on cold memory. One-row decode step of
// the bundled SmolLM2 Q4_1 on an AMD EPYC Zen 5, 2 threads, alternating in one process: 2252 against 2446 us
// (AVX-512 build), 2637 against 2754 us (AVX2 build), against 4 KiB and no first rows; 8 KiB without the first rows
// was as slow as 4 KiB, and at three activation rows (bound by the dot products) 8 KiB was not faster.
inline int64_t prefetch_rows(int64_t row_bytes, int64_t activation_rows) {
  if (activation_rows > 4) return 4;
  const int64_t bytes = activation_rows == 1 ? 8192 : 4096;
  return std::max<int64_t>(4, (bytes + row_bytes - 1) / row_bytes);
}
inline void prefetch_first(const uint8_t* w, int64_t ldw, int64_t n_begin, int64_t n_end, int64_t ahead) {
  const int64_t end = std::min(n_end, n_begin + ahead) * ldw;
  for (int64_t o = n_begin * ldw; o < end; o += 64) __builtin_prefetch(w + o);
}

// out[m * ldo + n] = x[m] . W[n] (+ bias[n]) for n in [n_begin, n_end), m < M; W's rows of blocks `ldw` bytes apart.
template <int T, typename O>
void qlinear_range(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                   int64_t n_begin, int64_t n_end, QScratch& s) {
  constexpr Layout L = layout_of(T);
  constexpr int subs = L.elems / kQK;
  const int64_t K = x.K, nb = K / L.elems;
  const int64_t ahead = prefetch_rows(ldw, M);
  s.row_buffers(K);
  float *sc2 = s.sc2.data(), *mins = s.mins.data();
  int8_t* decoded = s.w.data();
  const bool fused = fused_rows_max(T) > 0 && M <= fused_rows_max(T);
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * ldw;
    if (n + ahead < n_end)
      for (int64_t o = 0; o < ldw; o += 64) __builtin_prefetch(row + ahead * ldw + o);
    if constexpr (!scales_inline(T))
      for (int64_t b = 0; b < nb; ++b) scales_block<T>(row + b * L.bytes, sc2 + 2 * subs * b, mins + subs * b);
    const float bn = bias ? bias[n] : 0.f;
    auto all_rows = [&](const auto& src) {  // groups of four rows, then two, then one
      float res[4];
      int64_t m = 0;
      auto put = [&](int count) {
        for (int r = 0; r < count; ++r) out[(m + r) * ldo + n] = static_cast<O>(res[r] + bn);
        m += count;
      };
      while (m + 4 <= M) dot_rows<T, 4>(src, row, sc2, mins, x, m, res), put(4);
      if (m + 2 <= M) dot_rows<T, 2>(src, row, sc2, mins, x, m, res), put(2);
      if (m < M) dot_rows<T, 1>(src, row, sc2, mins, x, m, res), put(1);
    };
    if (fused) {
      all_rows([&](int64_t g) { return weights32<T>(row + g / subs * L.bytes, static_cast<int>(g % subs)); });
    } else {
      for (int64_t b = 0; b < nb; ++b) {  // block by block, its groups unrolled (constant shifts, loads shared)
        const uint8_t* block = row + b * L.bytes;
#pragma GCC unroll 8
        for (int j = 0; j < subs; ++j) store32(decoded + (b * subs + j) * kQK, weights32<T>(block, j));
      }
      all_rows([&](int64_t g) { return load32(decoded + g * kQK); });
    }
  }
}

// n f16 values (n even) as float32, eight per conversion where the CPU has F16C; `out` holds n rounded up to 8 (a
// partial last chunk is read masked, and its lanes past n written as 0).
inline void halves_to_floats(const uint8_t* p, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
  if (i < n) {  // pairs of halves: 32-bit lanes
    const __m128i mask = _mm256_castsi256_si128(lanes_below((n - i) / 2));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_maskload_epi32(reinterpret_cast<const int*>(p + 2 * i), mask)));
  }
#else
  for (; i < n; ++i) out[i] = half_to_float(p + 2 * i);
  for (; i % 8; ++i) out[i] = 0.f;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)
// The 64 weights of groups g, g + 1 from their 32 bytes of nibbles at p: g's in the low 256 bits, g + 1's above.
inline __m512i nibbles64(const uint8_t* p) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1),
                          _mm512_set1_epi8(0xF));
}
// A row's two 512-bit accumulators summed as dot_rows sums its four: (acc0 + acc2) in the low half and
// (acc1 + acc3) in the high one, then the halves, then across lanes.
inline float hsum_pairs(__m512 a, __m512 b) {
  const __m512 sum = _mm512_add_ps(a, b);
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(sum),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1))));
}
#endif

// Row-packed Q4_0 / Q4_1 / Q8_0 (quant.h): res[r] = x[m0 + r] . row for r < R. `sc` holds each activation row's
// group scales times the weight row's (`wd`), so a group's scale is one broadcast load; each 32-byte load of nibbles
// (64-byte load of Q8_0 values) gives two groups of weights, each multiplied with up to four activation rows. kAccs
// accumulators a row (group g into the (g mod kAccs)th, as dot_rows), the minimums `wm` added at the end: the same
// sums in the same order as dot_rows on the file's blocks (bitwise its results; packed Q8_0 in the AVX-512 build
// excepted, kUnsignedQ8), whatever R.
// Where the weights of groups g, g + 1 (g even) are: in a packed Q4_0 / Q4_1 row, their 32 bytes of nibbles one
// pair after the other; in a Q4_K row, the same inside its 144-byte blocks (after each block's 16 bytes of scales);
// in a packed Q8_0 row, their 64 bytes (group g's 32, then g + 1's).
template <int T>
inline const uint8_t* nibbles_of(const uint8_t* row, int64_t g) {
  if constexpr (T == kQ4_K) return row + g / 8 * layout_of(kQ4_K).bytes + 16 + 16 * (g % 8);
  if constexpr (T == kQ8_0R) return row + 32 * g;
  return row + 16 * g;
}
// Packed Q8_0 in the AVX-512 build: `vpdpbusd` multiplies unsigned bytes, so each value is loaded as q + 128 (its
// sign bit flipped) and 128 times the activation group's sum is taken off at the end, as Q4_0's offset of 8 is: one
// instruction a 64-value load instead of the sign trick's two per 32 and activation row. Elsewhere the values are
// multiplied signed, as the file's Q8_0 blocks are (AVX2: the sign trick; `vpmaddubsw` would saturate its int16
// pair sums on unsigned values up to 255).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)
constexpr bool kUnsignedQ8 = true;
#else
constexpr bool kUnsignedQ8 = false;
#endif
// Where a packed row's f16 scales start (after its K weights' bytes), and the minimum each scale d makes of the
// offset its values carry as the kernels multiply them (Q4_0: d * (q - 8); Q8_0 in the AVX-512 build: d * (u - 128)).
template <int T>
constexpr int64_t scales_at(int64_t K) { return T == kQ8_0R ? K : K / 2; }
template <int T>
constexpr float offset_min() { return T == kQ8_0R ? (kUnsignedQ8 ? -128.f : 0.f) : -8.f; }
// Whether a packed row's groups have minimums to add (Q8_0 multiplied signed has none).
template <int T>
constexpr bool has_mins() { return T != kQ8_0R || kUnsignedQ8; }
// Value i (0-31) of group g of a packed row or Q4_K row (Q8_0's signed, the others' unsigned).
template <int T>
inline int32_t packed_value(const uint8_t* row, int64_t g, int i) {
  if constexpr (T == kQ8_0R) return static_cast<int8_t>(nibbles_of<T>(row, g & ~int64_t{1})[32 * (g & 1) + i]);
  return (nibbles_of<T>(row, g & ~int64_t{1})[i] >> (g & 1 ? 4 : 0)) & 0xF;
}
#if defined(__AVX2__)
// The two groups' 32 weights each at p (as nibbles_of gives it): g's in w0, g + 1's in w1 (packed Q8_0's signed).
template <int T>
inline void weights_pair(const uint8_t* p, __m256i& w0, __m256i& w1) {
  if constexpr (T == kQ8_0R) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  } else {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), low = _mm256_set1_epi8(0xF);
    w0 = _mm256_and_si256(q, low);
    w1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
  }
}
// The int8 dot of 32 weights from weights_pair with 32 activations: `magnitude<T>(w)` once per weights, then
// `dot_pair<T>(that, w, a)` per activation row (packed Q8_0's signed weights by the sign trick: |w| times a with
// w's sign).
template <int T>
inline __m256i magnitude(__m256i w) { return T == kQ8_0R ? _mm256_sign_epi8(w, w) : w; }
template <int T>
inline __m256i dot_pair(__m256i wu, __m256i w, __m256i a) {
  return dot_u8s8(wu, T == kQ8_0R ? _mm256_sign_epi8(a, w) : a);
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)
// The same 64 weights in one register: g's in the low 256 bits, g + 1's above.
template <int T>
inline __m512i weights64(const uint8_t* p) {
  if constexpr (T == kQ8_0R) return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(static_cast<char>(0x80)));
  return nibbles64(p);
}
#endif

template <int T, int R>
inline void dot_packed(const uint8_t* row, const float* wm, const float* sc, int64_t ldsc, const QRows& x, int64_t m0,
                       float* res) {
  const int64_t K = x.K, groups = K / kQK;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)
  // A pair of groups in one 512-bit register (g in lanes 0-7, g + 1 in lanes 8-15): one VNNI dot, one conversion
  // and one FMA a pair and activation row, pairs taken in turn by two accumulators (two FMA chains, where one's
  // latency bounds a row at one activation row). Lane for lane the same sums as dot_rows' four (kAccs) on this
  // build: acc[0] holds its acc0 and acc1, acc[1] its acc2 and acc3.
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  auto pair = [&](int64_t g, __m512* acc) {
    const __m512i w = weights64<T>(nibbles_of<T>(row, g));
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_loadu_si512(x.q + (m0 + r) * K + g * kQK);
      const __m128 s2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sc + r * ldsc + g)));
      const __m512 scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(s2));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a)), scale, acc[r]);
    }
  };
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) {
    pair(g, acc[0]);
    pair(g + 2, acc[1]);
  }
  if (g < groups) pair(g, acc[0]);
  for (int r = 0; r < R; ++r) res[r] = hsum_pairs(acc[0][r], acc[1][r]);
#elif defined(__AVX2__)
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g += 2) {
    __m256i w0, w1;
    weights_pair<T>(nibbles_of<T>(row, g), w0, w1);
    const __m256i u0 = magnitude<T>(w0), u1 = magnitude<T>(w1);
    for (int r = 0; r < R; ++r) {
      const int8_t* a = x.q + (m0 + r) * K + g * kQK;
      const float* s = sc + r * ldsc + g;
      const __m256i p0 = dot_pair<T>(u0, w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
      const __m256i p1 = dot_pair<T>(u1, w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kQK)));
      acc0[r] = madd8(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(s), acc0[r]);
      acc1[r] = madd8(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(s + 1), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
#else
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = x.q + (m0 + r) * K;
    float lanes[2][8] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = sc[r * ldsc + g];
      for (int lane = 0; lane < 8; ++lane) {
        int32_t p = 0;
        for (int i = 0; i < 4; ++i) p += packed_value<T>(row, g, 4 * lane + i) * xq[g * kQK + 4 * lane + i];
        lanes[g & 1][lane] += static_cast<float>(p) * scale;
      }
    }
    float l[8];
    for (int i = 0; i < 8; ++i) l[i] = lanes[0][i] + lanes[1][i];
    res[r] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  }
#endif
  if constexpr (has_mins<T>()) add_mins<R>(wm, x, m0, res);
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight groups' weight scales and minimums from group g of a packed row (or a Q4_K row), in registers: n <= 8 of
// them (n even), lanes past n zero, as the scratch arrays hold them.
template <int T>
inline void scales8_regs(const uint8_t* row, int64_t K, int64_t groups, int64_t g, int64_t n, __m256& wd,
                         __m256& wm) {
  if constexpr (T == kQ4_K) {
    const uint8_t* b = row + g / 8 * layout_of(kQ4_K).bytes;
    alignas(32) float sc8[8], mins8[8];
    scales8_q4k(b, sc8, mins8);
    wd = _mm256_load_ps(sc8);
    wm = _mm256_load_ps(mins8);
  } else {
    auto halves8 = [&](const uint8_t* p) {
      return n == 8 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                    : _mm256_cvtph_ps(_mm_maskload_epi32(reinterpret_cast<const int*>(p),
                                                         _mm256_castsi256_si128(lanes_below(n / 2))));
    };
    wd = halves8(row + scales_at<T>(K) + 2 * g);
    wm = T == kQ4_1R ? halves8(row + K / 2 + 2 * groups + 2 * g) : _mm256_mul_ps(_mm256_set1_ps(offset_min<T>()), wd);
  }
}

// dot_packed<T, 1> for N weight rows (`ldw` bytes apart) at once, with their scales and minimums converted in
// registers, eight groups at a time, instead of through the scratch arrays: for each, the same products and sums
// in the same order (bitwise dot_packed's result). The AVX2 body broadcasts a group's scale from a small stack copy
// of the eight (a load, where a register permute competes with the dot's shuffles: 13.0-13.6 against 14.1-14.9 ns
// a row at K = 576, AMD EPYC Zen 5, AVX2 build).
template <int T, int N>
inline void dot_packed_one(const uint8_t* row0, int64_t ldw, const QRows& x, int64_t m, float* res) {
  const int64_t K = x.K, groups = K / kQK;
  const int8_t* xq = x.q + m * K;
  const float *xd = x.d + m * groups, *xs = x.s + m * groups;
  __m256 macc[N];
  for (int i = 0; i < N; ++i) macc[i] = _mm256_setzero_ps();
  // set_scales(i, s): keep weight row i's eight group scales (times the activation's) for pair(g, p), which
  // multiplies groups g, g + 1 (the chunk's pair p) into each row's accumulators.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)
  __m512 acc[N][2], s8[N];
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  auto set_scales = [&](int i, __m256 s) { s8[i] = _mm512_castps256_ps512(s); };
  auto pair = [&](int64_t g, int p) {
    const __m512i a = _mm512_loadu_si512(xq + g * kQK);
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * p)),
                                           _mm256_set1_epi32(2 * p + 1), 1);
    for (int i = 0; i < N; ++i) {
      const __m512i w = weights64<T>(nibbles_of<T>(row0 + i * ldw, g));
      const __m512 scale = _mm512_permutexvar_ps(idx, s8[i]);
      acc[i][p & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a)), scale,
                                      acc[i][p & 1]);
    }
  };
#else
  __m256 acc[N][2];
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  alignas(32) float s8[N][8];
  auto set_scales = [&](int i, __m256 s) { _mm256_store_ps(s8[i], s); };
  auto pair = [&](int64_t g, int p) {
    const int8_t* a = xq + g * kQK;
    const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                  a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kQK));
    for (int i = 0; i < N; ++i) {
      __m256i w0, w1;
      weights_pair<T>(nibbles_of<T>(row0 + i * ldw, g), w0, w1);
      const __m256i p0 = dot_pair<T>(magnitude<T>(w0), w0, a0), p1 = dot_pair<T>(magnitude<T>(w1), w1, a1);
      acc[i][0] = madd8(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(&s8[i][2 * p]), acc[i][0]);
      acc[i][1] = madd8(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(&s8[i][2 * p + 1]), acc[i][1]);
    }
  };
#endif
  int64_t g = 0;
  auto chunk = [&](int64_t n, __m256 da, __m256 sa) {
    for (int i = 0; i < N; ++i) {
      __m256 wd, wm;
      scales8_regs<T>(row0 + i * ldw, K, groups, g, n, wd, wm);
      if constexpr (has_mins<T>()) macc[i] = madd8(wm, sa, macc[i]);
      set_scales(i, _mm256_mul_ps(wd, da));
    }
    if (n == 8) {
      pair(g, 0), pair(g + 2, 1), pair(g + 4, 2), pair(g + 6, 3);
    } else {
      for (int p = 0; 2 * p < n; ++p) pair(g + 2 * p, p);
    }
  };
  for (; g + 8 <= groups; g += 8) chunk(8, _mm256_loadu_ps(xd + g), _mm256_loadu_ps(xs + g));
  if (g < groups) {
    const __m256i mask = lanes_below(groups - g);
    chunk(groups - g, _mm256_maskload_ps(xd + g, mask), _mm256_maskload_ps(xs + g, mask));
  }
  for (int i = 0; i < N; ++i) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)
    res[i] = hsum_pairs(acc[i][0], acc[i][1]);
#else
    res[i] = hsum8(_mm256_add_ps(acc[i][0], acc[i][1]));
#endif
    if constexpr (has_mins<T>()) res[i] += hsum8(macc[i]);
  }
}

// With fewer than kFewRows activation rows: kWeightRows weight rows at a time, their scales in registers
// (dot_packed_one), for each activation row in turn; the rows past the last whole kWeightRows one at a time. One
// thread, one activation row, L2-resident packed Q4_1 rows (scripts/bench_qdot.py), AMD EPYC Zen 5: 10.8-11.4
// against 16.5-17.3 ns a row at K = 576 and 19.8-20.3 against 28.7-29.4 at K = 1536 (AVX-512 build), 13.0-13.6
// against 15.9-17.3 at K = 576 (AVX2 build); at two activation rows 21.6 against 30 ns a weight row, at three 32
// against 43. From four rows on, dot_packed's groups of four activation rows are as fast (41-42 ns at four).
constexpr int kWeightRows = 4, kFewRows = 4;

template <int T, typename O>
void qlinear_few_packed(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                        int64_t ldo, int64_t n_begin, int64_t n_end, int64_t ahead) {
  float res[kWeightRows];
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end;) {
    const uint8_t* row = w + n * ldw;
    const int64_t count = n + kWeightRows <= n_end ? kWeightRows : 1;
    const int64_t fetch_end = std::min(n_end, n + ahead + count) * ldw;  // the next rows, `ahead` rows ahead
    for (int64_t o = (n + ahead) * ldw; o < fetch_end; o += 64) __builtin_prefetch(w + o);
    for (int64_t m = 0; m < M; ++m) {
      if (count == kWeightRows)
        dot_packed_one<T, kWeightRows>(row, ldw, x, m, res);
      else
        dot_packed_one<T, 1>(row, ldw, x, m, res);
      for (int64_t i = 0; i < count; ++i) out[m * ldo + n + i] = static_cast<O>(res[i] + (bias ? bias[n + i] : 0.f));
    }
    n += count;
  }
}
#endif

template <int T, typename O>
void qlinear_range_packed(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                          int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  const int64_t K = x.K, groups = K / kQK, gpad = (groups + 7) / 8 * 8;
  const int64_t ahead = prefetch_rows(ldw, M);
#if defined(__AVX2__) && defined(__F16C__)
  if (M < kFewRows) return qlinear_few_packed<T>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, ahead);
#endif
  s.row_buffers(K);
  float *wd = s.sc2.data(), *wm = s.mins.data(), *sc = s.sc.data();
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * ldw;
    if (n + ahead < n_end)
      for (int64_t o = 0; o < ldw; o += 64) __builtin_prefetch(row + ahead * ldw + o);
    if constexpr (T == kQ4_K) {  // (Q4_K rows hold whole 8-group blocks: no partial chunk)
      for (int64_t b = 0; b < groups / 8; ++b) scales8_q4k(row + b * layout_of(kQ4_K).bytes, wd + 8 * b, wm + 8 * b);
    } else {
      halves_to_floats(row + scales_at<T>(K), groups, wd);
    }
    if constexpr (T == kQ4_1R) {
      halves_to_floats(row + K / 2 + 2 * groups, groups, wm);
    } else if constexpr ((T == kQ4_0R || T == kQ8_0R) && has_mins<T>()) {
      for (int64_t g = 0; g < gpad; ++g) wm[g] = offset_min<T>() * wd[g];  // d * (q - 8) = d * q - 8d (or 128)
    }
    const float bn = bias ? bias[n] : 0.f;
    float res[4];
    int64_t m = 0;
    auto rows = [&](auto count) {
      constexpr int C = decltype(count)::value;
      for (int r = 0; r < C; ++r) {  // each activation row's group scales times the weight row's
        const float* da = x.d + (m + r) * groups;
#if defined(__AVX2__)
        int64_t g = 0;
        for (; g + 8 <= groups; g += 8)
          _mm256_storeu_ps(sc + r * gpad + g, _mm256_mul_ps(_mm256_loadu_ps(wd + g), _mm256_loadu_ps(da + g)));
        if (g < groups)
          _mm256_storeu_ps(sc + r * gpad + g, _mm256_mul_ps(_mm256_loadu_ps(wd + g),
                                                            _mm256_maskload_ps(da + g, lanes_below(groups - g))));
#else
        for (int64_t g = 0; g < groups; ++g) sc[r * gpad + g] = wd[g] * da[g];
#endif
      }
      dot_packed<T, C>(row, wm, sc, gpad, x, m, res);
      for (int r = 0; r < C; ++r) out[(m + r) * ldo + n] = static_cast<O>(res[r] + bn);
      m += C;
    };
    while (m + 4 <= M) rows(std::integral_constant<int, 4>{});
    if (m + 2 <= M) rows(std::integral_constant<int, 2>{});
    if (m < M) rows(std::integral_constant<int, 1>{});
  }
}

template <typename O>
void qlinear_rows(int type, const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                  int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  switch (type) {
    case kQ4_0: return qlinear_range<kQ4_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_1: return qlinear_range<kQ4_1>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ5_0: return qlinear_range<kQ5_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ5_1: return qlinear_range<kQ5_1>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ8_0: return qlinear_range<kQ8_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_K: return qlinear_range_packed<kQ4_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ6_K: return qlinear_range<kQ6_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_0R: return qlinear_range_packed<kQ4_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_1R: return qlinear_range_packed<kQ4_1R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ8_0R: return qlinear_range_packed<kQ8_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    default: return;  // the callers check the type first (supported())
  }
}

inline bool supported(int64_t type) { return layout_of(static_cast<int>(type)).elems > 0; }

// One row of an embedding table kept quantized, as float32.
inline void dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  auto rows = [&](auto t) { dequant_whole_row<decltype(t)::value>(row, K, out); };
  switch (type) {
    case kQ4_0: return rows(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return rows(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return rows(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return rows(std::integral_constant<int, kQ5_1>{});
    case kQ8_0: return rows(std::integral_constant<int, kQ8_0>{});
    case kQ4_K: return rows(std::integral_constant<int, kQ4_K>{});
    case kQ6_K: return rows(std::integral_constant<int, kQ6_K>{});
    case kQ4_0R: return rows(std::integral_constant<int, kQ4_0R>{});
    case kQ4_1R: return rows(std::integral_constant<int, kQ4_1R>{});
    case kQ8_0R: return rows(std::integral_constant<int, kQ8_0R>{});
    default: return;
  }
}

}  // namespace peregrine_quant
