// GGUF block formats kept quantized in RAM (built by engine/backends/quant_kernels.py, one module per ISA level).
//
// Each format is a run of fixed-size blocks along a weight row; `dequant_block<T>` turns one block into
// float32 the way ggml's dequantize_row_* does. The code is written once, plainly: GCC's vector extensions
// and auto-vectorization give AVX2/FMA, AVX-512 or SSE2 code from the flags of each build (and NEON on
// aarch64), so every ISA level shares one source and one set of answers up to float rounding.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace peregrine_quant {

// ggml's type ids (ggml.h: enum ggml_type), as GGUF files store them; and Peregrine's row-packed Q4_0, Q4_1 and Q8_0
// (ids past ggml's), made at load from the file's blocks (engine/model/quant.py: `QuantWeight.repack`). A row of K values
// (K a multiple of 64) holds the same values as its GGUF blocks, rearranged:
//   Q4_0 / Q4_1: K / 2 bytes of nibbles, 32 bytes per pair of 32-value groups: the low nibbles are the first group's
//   values in order, the high nibbles the second's (one 32-byte load gives 64 weights); then the K / 32 f16 scales
//   d, then (Q4_1) the K / 32 f16 minimums m (eight converted by one instruction). A value is d * (q - 8) (Q4_0) or
//   d * q + m (Q4_1), as in the file.
//   Q8_0: the K int8 values in order (one 64-byte load is two groups), then the K / 32 f16 scales d. A value is
//   d * q, as in the file.
// The tiled forms (kQ4_0T / kQ4_1T / kQ8_0T, the packed id + 1000) hold the same bytes as the packed rows, each 16
// rows (a tile, 16 x the row's bytes, where the 16 rows lay) transposed for the 16-lane loops of the AVX-512 VNNI
// builds (qdot_lanes.h), which then read a tile front to back with no shuffles: first the values, each 32-byte chunk
// of the 16 rows as 512 bytes, 64 for each of its eight dwords (dword i of row j at 64 i + 4 j); then the scale
// halves, 32 bytes each (half h of row j at 32 h + 2 j). Q4_K's tiled form (kQ4_KT, from the file's blocks) takes
// each super-block of the 16 rows as 2,304 bytes, its 36 dwords (d and dmin, the scales, the nibbles) 64 bytes each
// (dword i of row j at 64 i + 4 j), Q5_K's (kQ5_KT) as 2,816 bytes, its 44 dwords (d and dmin, the scales, the fifth
// bits, the nibbles) so; Q6_K's (kQ6_KT) each super-block as 3,360 bytes, its first 52 dwords (ql, qh, the scales)
// so, then the 16 rows' f16 d (row j's at 3,328 + 2 j); Q5_0's (kQ5_0T) each 32-value group of the 16 rows as 352
// bytes: the fifth bits (row j's at 4 j), the four dwords of nibbles (dword i of row j at 64 + 64 i + 4 j), then the
// f16 d (row j's at 320 + 2 j), as its 22-byte blocks would be with d moved last. Only whole tiles: a matrix of a
// multiple of 16 rows. Made at start by engine/model/quant.py (`QuantWeight.tile_`) for the one-call
// decoder's weights; a row is read on its own only through `untile_row` (a tied embedding).
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20,
  kIQ4_XS = 23, kQ4_0R = 1002, kQ4_1R = 1003, kQ8_0R = 1008, kQ4_0T = 2002, kQ4_1T = 2003, kQ8_0T = 2008,
  kQ5_0T = 2006, kQ4_KT = 2012, kQ5_KT = 2013, kQ6_KT = 2014,
};

constexpr bool row_packed(int type) { return type == kQ4_0R || type == kQ4_1R || type == kQ8_0R; }
constexpr bool tiled(int type) {
  return type == kQ4_0T || type == kQ4_1T || type == kQ8_0T || type == kQ5_0T || type == kQ4_KT || type == kQ5_KT ||
         type == kQ6_KT;
}
constexpr int untiled(int type) {  // the form a tiled one was made from
  return type == kQ5_0T ? kQ5_0 : type == kQ4_KT || type == kQ5_KT || type == kQ6_KT ? type - 2000 : type - 1000;
}
constexpr int64_t kTileRows = 16;  // the rows of a tile of the tiled forms

struct Layout {
  int elems;  // weights per block
  int bytes;  // bytes per block
};

constexpr Layout layout_of(int type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    case kIQ4_NL: return {32, 18};
    case kIQ4_XS: return {256, 136};
    case kQ4_0R: return {64, 36};  // row-packed: whole rows only; bytes per 64 values
    case kQ4_1R: return {64, 40};
    case kQ8_0R: return {64, 68};
    case kQ4_0T: return {64, 36};  // tiled: as the packed rows, whole tiles of 16 rows only
    case kQ4_1T: return {64, 40};
    case kQ8_0T: return {64, 68};
    case kQ5_0T: return {32, 22};
    case kQ4_KT: return {256, 144};
    case kQ5_KT: return {256, 176};
    case kQ6_KT: return {256, 210};
    default: return {0, 0};
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

template <int T>
inline void dequant_block(const uint8_t* b, float* __restrict y);

template <>
inline void dequant_block<kQ8_0>(const uint8_t* b, float* __restrict y) {  // f16 d, int8 q[32]: d * q
  const float d = half_to_float(b);
  int8_t q[32];
  std::memcpy(q, b + 2, 32);
  for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(q[i]);
}

template <>
inline void dequant_block<kQ4_0>(const uint8_t* b, float* __restrict y) {  // f16 d, nibbles: low half, then high half
  const float d = half_to_float(b);
  uint8_t q[16];
  std::memcpy(q, b + 2, 16);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>((q[i] & 0xF) - 8);
    y[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
  }
}

template <>
inline void dequant_block<kQ4_1>(const uint8_t* b, float* __restrict y) {  // f16 d, f16 m, nibbles: q * d + m
  const float d = half_to_float(b), m = half_to_float(b + 2);
  uint8_t q[16];
  std::memcpy(q, b + 4, 16);
  for (int i = 0; i < 16; ++i) {
    y[i] = static_cast<float>(q[i] & 0xF) * d + m;
    y[i + 16] = static_cast<float>(q[i] >> 4) * d + m;
  }
}

// Q5_0 / Q5_1: 16 bytes of nibbles as Q4_0's (low: values 0-15, high: 16-31) and a 32-bit word of fifth bits
// (bit i: value i's); f16 d, then (Q5_1) f16 m, then the word, then the nibbles. d * (q - 16) or d * q + m.
inline uint32_t fifth_bits(const uint8_t* p) {
  uint32_t h;
  std::memcpy(&h, p, 4);
  return h;
}

template <>
inline void dequant_block<kQ5_0>(const uint8_t* b, float* __restrict y) {
  const float d = half_to_float(b);
  const uint32_t h = fifth_bits(b + 2);
  uint8_t q[16];
  std::memcpy(q, b + 6, 16);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(static_cast<int>((q[i] & 0xF) | (((h >> i) & 1) << 4)) - 16);
    y[i + 16] = d * static_cast<float>(static_cast<int>((q[i] >> 4) | (((h >> (i + 16)) & 1) << 4)) - 16);
  }
}

template <>
inline void dequant_block<kQ5_1>(const uint8_t* b, float* __restrict y) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint32_t h = fifth_bits(b + 4);
  uint8_t q[16];
  std::memcpy(q, b + 8, 16);
  for (int i = 0; i < 16; ++i) {
    y[i] = static_cast<float>((q[i] & 0xF) | (((h >> i) & 1) << 4)) * d + m;
    y[i + 16] = static_cast<float>((q[i] >> 4) | (((h >> (i + 16)) & 1) << 4)) * d + m;
  }
}

// Q4_K's 6-bit sub-block scale and min (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

template <>
inline void dequant_block<kQ4_K>(const uint8_t* b, float* __restrict y) {  // f16 d, f16 dmin, scales[12], qs[128]
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  uint8_t qs[128];
  std::memcpy(qs, b + 16, 128);
  const uint8_t* q = qs;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {  // 64 weights: 32 low nibbles, then 32 high
    uint8_t sc, mn;
    scale_min_k4(2 * j, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    scale_min_k4(2 * j + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
      y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

// Q5_K: Q4_K's d, dmin and 6-bit scales / minimums, then qh[32] (a fifth bit a value: bit 2j of qh[l] is value
// 64j + l's, bit 2j + 1 value 64j + 32 + l's), then Q4_K's qs[128]. d * sc * q - dmin * mn, q 0-31.
template <>
inline void dequant_block<kQ5_K>(const uint8_t* b, float* __restrict y) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  uint8_t qh[32], qs[128];
  std::memcpy(qh, b + 16, 32);
  std::memcpy(qs, b + 48, 128);
  const uint8_t* q = qs;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    uint8_t sc, mn;
    scale_min_k4(2 * j, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    scale_min_k4(2 * j + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * static_cast<float>((q[l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4)) - m1;
      y[l + 32] = d2 * static_cast<float>((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) - m2;
    }
  }
}

template <>
inline void dequant_block<kQ6_K>(const uint8_t* b, float* __restrict y) {  // ql[128], qh[64], int8 scales[16], f16 d
  uint8_t raw[208];  // a local copy: the float stores cannot alias it, so the loops vectorize
  std::memcpy(raw, b, 208);
  const uint8_t* ql = raw;
  const uint8_t* qh = raw + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(raw + 192);
  const float d = half_to_float(b + 208);
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int half = 0; half < 2; ++half) {  // 16 weights share each scale
      const float s1 = d * sc[half], s2 = d * sc[half + 2], s3 = d * sc[half + 4], s4 = d * sc[half + 6];
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int q1 = static_cast<int>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = s1 * static_cast<float>(q1);
        y[l + 32] = s2 * static_cast<float>(q2);
        y[l + 64] = s3 * static_cast<float>(q3);
        y[l + 96] = s4 * static_cast<float>(q4);
      }
    }
  }
}

// IQ4_NL and IQ4_XS: 4-bit indices into one non-uniform table of 16 signed values (ggml's kvalues_iq4nl), nibbles
// laid out as Q4_0's in each 32 values (low: values 0-15, high: 16-31).
//   IQ4_NL: a block of 32, f16 d then 16 bytes of nibbles; d * kIQ4[q].
//   IQ4_XS: a super-block of 256, f16 d, uint16 scales_h, uint8 scales_l[4], qs[128] (16 bytes a 32-value group j);
//   group j's 6-bit scale ls_j (low 4 bits from scales_l, high 2 from scales_h, iq4xs_scale) gives
//   d * (ls_j - 32) * kIQ4[q].
alignas(16) inline constexpr int8_t kIQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                1,    13,   25,  38,  53,  69,  89,  113};

inline int iq4xs_scale(const uint8_t* b, int j) {  // ls_j - 32, in [-32, 31]
  const int high = (b[2 + j / 4] >> (2 * (j % 4))) & 3;  // scales_h, little-endian: bits 2j, 2j + 1
  return (((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (high << 4)) - 32;
}

template <>
inline void dequant_block<kIQ4_NL>(const uint8_t* b, float* __restrict y) {
  const float d = half_to_float(b);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(kIQ4[b[2 + i] & 0xF]);
    y[i + 16] = d * static_cast<float>(kIQ4[b[2 + i] >> 4]);
  }
}

template <>
inline void dequant_block<kIQ4_XS>(const uint8_t* b, float* __restrict y) {
  const float d = half_to_float(b);
  for (int j = 0; j < 8; ++j, y += 32) {
    const float dl = d * static_cast<float>(iq4xs_scale(b, j));
    const uint8_t* q = b + 8 + 16 * j;
    for (int i = 0; i < 16; ++i) {
      y[i] = dl * static_cast<float>(kIQ4[q[i] & 0xF]);
      y[i + 16] = dl * static_cast<float>(kIQ4[q[i] >> 4]);
    }
  }
}

// A row-packed Q4_0 / Q4_1 / Q8_0 row of K values as float32 (the same values as its GGUF blocks give).
template <int T>
inline void dequant_packed_row(const uint8_t* row, int64_t K, float* __restrict y) {
  const int64_t groups = K / 32;
  if constexpr (T == kQ8_0R) {
    for (int64_t g = 0; g < groups; ++g, y += 32) {
      const float d = half_to_float(row + K + 2 * g);
      uint8_t q[32];
      std::memcpy(q, row + 32 * g, 32);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(q[i]));
    }
    return;
  }
  const uint8_t* scales = row + K / 2;
  for (int64_t g = 0; g < groups; g += 2, y += 64) {
    const float d0 = half_to_float(scales + 2 * g), d1 = half_to_float(scales + 2 * g + 2);
    const float m0 = T == kQ4_1R ? half_to_float(scales + 2 * groups + 2 * g) : 0.f,
                m1 = T == kQ4_1R ? half_to_float(scales + 2 * groups + 2 * g + 2) : 0.f;
    uint8_t q[32];
    std::memcpy(q, row + 16 * g, 32);
    for (int i = 0; i < 32; ++i) {
      if constexpr (T == kQ4_0R) {
        y[i] = d0 * static_cast<float>((q[i] & 0xF) - 8);
        y[i + 32] = d1 * static_cast<float>((q[i] >> 4) - 8);
      } else {
        y[i] = static_cast<float>(q[i] & 0xF) * d0 + m0;
        y[i + 32] = static_cast<float>(q[i] >> 4) * d1 + m1;
      }
    }
  }
}

// One row of K values of format T as float32.
template <int T>
inline void dequant_whole_row(const uint8_t* row, int64_t K, float* __restrict y) {
  if constexpr (row_packed(T)) {
    dequant_packed_row<T>(row, K, y);
  } else {
    constexpr Layout L = layout_of(T);
    for (int64_t b = 0; b < K / L.elems; ++b) dequant_block<T>(row + b * L.bytes, y + b * L.elems);
  }
}

}  // namespace peregrine_quant
