// Q4_K and Q6_K rows (the file's blocks) in the AVX2 builds without AVX-512 VNNI (the avx2 and avx_vnni levels),
// eight weight rows at a time, one a 32-bit lane of a 256-bit register: qdot_lanes_k.h's design at half the width,
// with `vpmaddubsw` for `vpdpbusd`. A tile's super-block is decoded once into scratch (its four 32-byte pairs of
// groups of the eight rows transposed, 8 x 8 dwords, the nibbles split: 2 KiB), with its scales (each group's 6-bit
// scale of the eight rows in both int16 halves of their lanes), d and dmin * mn; then every activation row of the
// block meets it: a `vpmaddubsw` against one broadcast activation dword adds two pair sums to each of the eight rows,
// eight of them a group added in int16 (at most 8 x 2 x 15 x 128 = 30720: exact), one `vpmaddwd` by the group's
// scales to int32. The row loop (qdot_kquant.h) multiplies each weight row with each activation row on its own
// (`vpmaddubsw`, `vpmaddwd` and an add for 32 products) and reduces eight lanes a super-block; here one `vpmaddubsw`
// and one add give 32 products, and nothing is reduced across lanes. Q6_K (Lanes8BlockQ6, below) the same way: its
// six-bit values put together once a tile, 16-value groups with an int8 scale each, the offset of 32 in integers.
//
// Each lane is its row's own sequence: the super-block's exact int32 sum of scaled group sums, then fma(sum, d * dx,
// acc) and (Q4_K) the eight minimums' fnmadd, super-block by super-block: the operations of qdot_lanes_k.h's and
// qdot_lanes_q6.h's lanes, so a row's result is the same bits here, in the AVX-512 VNNI builds, in any tile, thread
// split or batch.
//
// The avx_vnni build multiplies with AVX-VNNI's 256-bit `vpdpbusd` instead: a group's products summed in int32 (two
// chains), times its scale by `vpmulld` (the scales kept as int32 lanes), Q6_K's offset started in each group's sum as
// the 16-lane loop starts it. The same exact integers, so the same bits. It also takes IQ4_XS (Lanes8BlockIQ4) the
// way qdot_lanes_iq4.h does at 16 lanes, for every number of activation rows.
#pragma once

#include "qdot_kquant.h"

namespace peregrine_quant {

// Value 128n + 32g + 4i .. + 3 of each lane's row from the transposed dwords of its half's low bits (l0: ql bytes
// 64n .. + 31, l1: the next 32) and high bits (h: qh bytes 32n .. + 31), as dequant_block<kQ6_K> reads them: groups 0
// and 2 the low and high nibbles of l0, 1 and 3 those of l1, the high bits two at a time from h (moved to bits 4-5 by
// one 16-bit shift and a mask: the shifts carry bits across bytes only into bits the mask drops).
template <int G, typename V, typename Ops>
inline V q6k_values(V l0, V l1, V h, Ops ops) {
  const V lowbits = G % 2 ? l1 : l0;
  V low = lowbits, high = h;
  if constexpr (G >= 2) low = ops.srli(lowbits, 4);
  if constexpr (G == 0) high = ops.slli(h, 4);
  if constexpr (G == 1) high = ops.slli(h, 2);
  if constexpr (G == 3) high = ops.srli(h, 2);
  return ops.or_(ops.and_(low, ops.set1(0xF)), ops.and_(high, ops.set1(0x30)));
}

// A half's four groups of 32 values, store(g, i, v) taking dword i of group g (v, one a lane) from q6k_values.
template <typename V, typename Ops, typename Store>
inline void q6k_half(const V l0[8], const V l1[8], const V h[8], Ops ops, Store&& store) {
  for (int i = 0; i < 8; ++i) {
    store(0, i, q6k_values<0>(l0[i], l1[i], h[i], ops));
    store(1, i, q6k_values<1>(l0[i], l1[i], h[i], ops));
    store(2, i, q6k_values<2>(l0[i], l1[i], h[i], ops));
    store(3, i, q6k_values<3>(l0[i], l1[i], h[i], ops));
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#if defined(__AVXVNNI__)
constexpr bool lanes_k8(int T) { return T == kQ4_K || T == kQ6_K || T == kIQ4_XS; }
#else
constexpr bool lanes_k8(int T) { return T == kQ4_K || T == kQ6_K; }
#endif
constexpr int kLanes8 = 8, kLanes8Ahead = 3;  // rows a tile; tiles ahead prefetched into L2

// r[k] (row k's eight dwords) to r[i] (dword i of rows 0-7, lane k row k's).
inline void transpose8_dwords(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int q = 0; q < 4; ++q) {
    t[2 * q] = _mm256_unpacklo_epi32(r[2 * q], r[2 * q + 1]);  // dwords 0, 1 (4, 5) of rows 2q, 2q + 1
    t[2 * q + 1] = _mm256_unpackhi_epi32(r[2 * q], r[2 * q + 1]);  // dwords 2, 3 (6, 7)
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3: u[4h + c] dword c (c + 4 in the high half)
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}

// m[k] (16 bytes of row k) to c[i]: byte 2i of rows 0-7 in bytes 0-7, byte 2i + 1 in bytes 8-15 (a tile's scales).
inline void columns8(const __m128i m[8], __m128i c[8]) {
  for (int h = 0; h < 2; ++h) {  // bytes 0-7 (h = 0) and 8-15 of the rows
    __m128i v[4];
    for (int q = 0; q < 4; ++q)  // byte pairs of rows 2q, 2q + 1
      v[q] = h ? _mm_unpackhi_epi8(m[2 * q], m[2 * q + 1]) : _mm_unpacklo_epi8(m[2 * q], m[2 * q + 1]);
    const __m128i a0 = _mm_unpacklo_epi16(v[0], v[1]), a1 = _mm_unpackhi_epi16(v[0], v[1]);  // rows 0-3
    const __m128i b0 = _mm_unpacklo_epi16(v[2], v[3]), b1 = _mm_unpackhi_epi16(v[2], v[3]);  // rows 4-7
    c[4 * h + 0] = _mm_unpacklo_epi32(a0, b0), c[4 * h + 1] = _mm_unpackhi_epi32(a0, b0);
    c[4 * h + 2] = _mm_unpacklo_epi32(a1, b1), c[4 * h + 3] = _mm_unpackhi_epi32(a1, b1);
  }
}

// The 256-bit operations of the width-generic helpers (q6k_values, q4k_scales_mins_lanes): 16-bit shifts and byte
// constants for the six-bit values, 32-bit ones for the scales.
struct Ops256 {
  __m256i and_(__m256i a, __m256i b) const { return _mm256_and_si256(a, b); }
  __m256i or_(__m256i a, __m256i b) const { return _mm256_or_si256(a, b); }
  __m256i srli(__m256i a, int n) const { return _mm256_srli_epi16(a, n); }
  __m256i slli(__m256i a, int n) const { return _mm256_slli_epi16(a, n); }
  __m256i set1(int v) const { return _mm256_set1_epi8(static_cast<char>(v)); }
  __m256i srli32(__m256i a, int n) const { return _mm256_srli_epi32(a, n); }
  __m256i set1_32(int v) const { return _mm256_set1_epi32(v); }
};

// Scratch for one tile's super-block: the eight groups' values (wd[8g + i]: values 4i .. 4i + 3 of group g of each
// lane's row), their scales (sc[g]: lane k row k's scale in both int16 halves; avx_vnni: in int32), d, and dmin * mn
// (mins[g]).
struct Lanes8Block {
  __m256i wd[64];
  __m256i sc[8];
  __m256 d, mins[8];
};

inline void decode_block8(const uint8_t* const p[kLanes8], int64_t at, Lanes8Block& blk) {
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int j = 0; j < 4; ++j) {  // pair j: group 2j in the low nibbles, 2j + 1 in the high ones
    __m256i t[8];
    for (int k = 0; k < kLanes8; ++k)
      t[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[k] + at + 16 + 32 * j));
    transpose8_dwords(t);
    for (int i = 0; i < 8; ++i) {
      _mm256_store_si256(&blk.wd[8 * (2 * j) + i], _mm256_and_si256(t[i], low));
      _mm256_store_si256(&blk.wd[8 * (2 * j + 1) + i], _mm256_and_si256(_mm256_srli_epi16(t[i], 4), low));
    }
  }
  // each row's first 16 bytes (f16 d, f16 dmin, 12 bytes of scales and minimums) as four registers of one dword a
  // row (y[i]: rows i and 4 + i, then a 4 x 4 dword transpose in each half), the scales and minimums unpacked in
  // the lanes, the eight rows at once (ggml's get_scale_min_k4, as q4k_scales_mins_x): unpacking each row's by
  // shuffles and transposing the bytes had cost about as many instructions as the values' transpose
  __m256i y[4], z[4], dw[4];
  for (int i = 0; i < 4; ++i)
    y[i] = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[i] + at))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[4 + i] + at)), 1);
  z[0] = _mm256_unpacklo_epi32(y[0], y[1]), z[1] = _mm256_unpackhi_epi32(y[0], y[1]);
  z[2] = _mm256_unpacklo_epi32(y[2], y[3]), z[3] = _mm256_unpackhi_epi32(y[2], y[3]);
  dw[0] = _mm256_unpacklo_epi64(z[0], z[2]), dw[1] = _mm256_unpackhi_epi64(z[0], z[2]);
  dw[2] = _mm256_unpacklo_epi64(z[1], z[3]), dw[3] = _mm256_unpackhi_epi64(z[1], z[3]);  // dw[c] lane k: row k's
  const __m256i half = _mm256_set1_epi32(0xFFFF);
  auto f16s = [](__m256i v) {  // the low 16 bits of each lane, as eight halves
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
  };
  blk.d = f16s(_mm256_and_si256(dw[0], half));
  const __m256 dmin = f16s(_mm256_srli_epi32(dw[0], 16));
  q4k_scales_mins_lanes(dw, Ops256{}, [&](int j, __m256i s_lo, __m256i s_hi, __m256i m_lo, __m256i m_hi) {
#if defined(__AVXVNNI__)  // int32 lanes, for `vpmulld` (lanes8_rows)
    _mm256_store_si256(&blk.sc[j], s_lo);
    _mm256_store_si256(&blk.sc[4 + j], s_hi);
#else
    _mm256_store_si256(&blk.sc[j], _mm256_or_si256(s_lo, _mm256_slli_epi32(s_lo, 16)));
    _mm256_store_si256(&blk.sc[4 + j], _mm256_or_si256(s_hi, _mm256_slli_epi32(s_hi, 16)));
#endif
    blk.mins[j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m_lo));
    blk.mins[4 + j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m_hi));
  });
}

// Activation rows m .. m + R - 1 at super-block b, as the lanes8_rows below read them: their int8 values (a[r]) and
// their 16-value sums (ks[r]).
template <int R>
struct Rows8 {
  const int8_t* a[R];
  const int16_t* ks[R];
  Rows8(const QRows& x, int64_t m, int64_t b) {
    for (int r = 0; r < R; ++r) {
      a[r] = x.kq + (m + r) * x.K + b * kQK_K;
      ks[r] = x.ks + (m + r) * (x.K / 16) + 16 * b;
    }
  }
};

// Four activations (an int8 dword) in every lane.
inline __m256i bcast4(const int8_t* v) {
  int32_t u;
  std::memcpy(&u, v, 4);
  return _mm256_set1_epi32(u);
}

// acc + sum x (d x kd): a super-block's exact integer sums (eight lanes) scaled by the lanes' d and the activation
// row's kd, added to the eight accumulators at acc.
inline __m256 scaled_sum8(__m256i sum, __m256 d, float kd, const float* acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(kd)), _mm256_loadu_ps(acc));
}

#if defined(__AVXVNNI__)
// p[r] += a 32-value group's products a lane (wd[0 .. 7] against a[r][0 .. 31], `vpdpbusd`, two chains), r < R.
template <int R>
__attribute__((always_inline)) inline void vnni_group8(const __m256i* wd, const int8_t* const a[R], int off,
                                                       __m256i* p) {
  __m256i q[R];
  for (int r = 0; r < R; ++r) q[r] = _mm256_setzero_si256();
  for (int i = 0; i < 8; i += 2) {
    const __m256i w0 = _mm256_load_si256(&wd[i]), w1 = _mm256_load_si256(&wd[i + 1]);
    for (int r = 0; r < R; ++r) {
      p[r] = _mm256_dpbusd_avx_epi32(p[r], w0, bcast4(a[r] + off + 4 * i));
      q[r] = _mm256_dpbusd_avx_epi32(q[r], w1, bcast4(a[r] + off + 4 * i + 4));
    }
  }
  for (int r = 0; r < R; ++r) p[r] = _mm256_add_epi32(p[r], q[r]);
}
#endif

// acc[r] (eight lanes) += activation row m + r's super-block b times the tile's decoded super-block, r < R: each
// decoded weight register loaded once for the R rows (a load for each `vpmaddubsw` was what bounded one row at a time:
// two loads a product of 32).
template <int R>
__attribute__((always_inline)) inline void lanes8_rows(const Lanes8Block& blk, const QRows& x, int64_t m, int64_t b,
                                                       float* accs) {
  const int64_t K = x.K, nb = K / kQK_K;
  const Rows8<R> in(x, m, b);
  __m256i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  for (int g = 0; g < 8; ++g) {
    __m256i p[R];
    for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
#if defined(__AVXVNNI__)  // a group's 32 products a lane in int32 (two chains), times its scale
    vnni_group8<R>(&blk.wd[8 * g], in.a, 32 * g, p);
    const __m256i sc = _mm256_load_si256(&blk.sc[g]);
    for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(p[r], sc));
#else
    for (int i = 0; i < 8; ++i) {
      const __m256i wv = _mm256_load_si256(&blk.wd[8 * g + i]);
      for (int r = 0; r < R; ++r)
        p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(wv, bcast4(in.a[r] + 32 * g + 4 * i)));
    }
    for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p[r], blk.sc[g]));
#endif
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = m + r;
    float* acc = accs + r * kLanes8;
    __m256 v = scaled_sum8(isum[r], blk.d, x.kd[row * nb + b], acc);
    const float* ksf = x.ksf + row * (K / kQK) + 8 * b;
    for (int j = 0; j < 8; ++j) v = _mm256_fnmadd_ps(blk.mins[j], _mm256_set1_ps(ksf[j]), v);
    _mm256_storeu_ps(acc, v);
  }
}

// Q6_K's super-block of the tile's eight rows, decoded: values 0-63 (q, without the offset of 32), wd[4s + i]
// values 16s + 4i .. + 3 of each lane's row (s a 16-value group, one int8 scale each); sc[s] group s's scale of each
// lane in both int16 halves (for `vpmaddwd` after `vpmaddubsw`; avx_vnni: in int32), scp[t] the scales of groups 2t
// and 2t + 1 as a lane's int16 pair (for the offset, 32 sum_s sc_s sum(a_s), one `vpmaddwd` against the activation's
// pair of sums; not used in the avx_vnni build).
struct Lanes8BlockQ6 {
  __m256i wd[64];
  __m256i sc[16];
  __m256i scp[8];
  __m256 d;
};

// The eight rows' int8 scales (16 bytes each) as 16 registers of eight int32 lanes: s32[s] lane k = row k's sc_s.
inline void q6k_scales8(const uint8_t* const p[kLanes8], int64_t at, __m256i s32[16]) {
  __m128i m[8], c[8];
  for (int k = 0; k < kLanes8; ++k) m[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[k] + at + 192));
  columns8(m, c);
  for (int i = 0; i < 8; ++i) {
    s32[2 * i] = _mm256_cvtepi8_epi32(c[i]);
    s32[2 * i + 1] = _mm256_cvtepi8_epi32(_mm_srli_si128(c[i], 8));
  }
}

inline void decode_block8(const uint8_t* const p[kLanes8], int64_t at, Lanes8BlockQ6& blk) {
  for (int n = 0; n < 2; ++n) {
    __m256i l0[8], l1[8], h[8];
    for (int k = 0; k < kLanes8; ++k) {
      l0[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[k] + at + 64 * n));
      l1[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[k] + at + 64 * n + 32));
      h[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[k] + at + 128 + 32 * n));
    }
    transpose8_dwords(l0);
    transpose8_dwords(l1);
    transpose8_dwords(h);
    q6k_half(l0, l1, h, Ops256{},
             [&](int g, int i, __m256i v) { _mm256_store_si256(&blk.wd[8 * (4 * n + g) + i], v); });
  }
  __m256i s32[16];
  q6k_scales8(p, at, s32);
#if defined(__AVXVNNI__)  // int32 lanes, for `vpmulld` (lanes8_rows)
  for (int s = 0; s < 16; ++s) _mm256_store_si256(&blk.sc[s], s32[s]);
#else
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  for (int s = 0; s < 16; ++s)
    _mm256_store_si256(&blk.sc[s], _mm256_or_si256(_mm256_and_si256(s32[s], lo16), _mm256_slli_epi32(s32[s], 16)));
  for (int t = 0; t < 8; ++t)
    _mm256_store_si256(&blk.scp[t],
                       _mm256_or_si256(_mm256_and_si256(s32[2 * t], lo16), _mm256_slli_epi32(s32[2 * t + 1], 16)));
#endif
  alignas(16) uint16_t dh[kLanes8];
  for (int k = 0; k < kLanes8; ++k) std::memcpy(&dh[k], p[k] + at + 208, 2);
  blk.d = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
}

// acc[r] (eight lanes) += activation row m + r's super-block b times the tile's decoded Q6_K super-block, r < R: a
// 16-value group's four `vpmaddubsw` added in int16 two at a time (four products of at most 63 x 128: exact), each
// pair times the group's scale by `vpmaddwd`; the offset 32 sum_s sc_s sum(a_s) taken off in int32 (the row loop's
// integers, qdot_kquant.h), then the float steps of the Q4_K lanes without minimums.
template <int R>
__attribute__((always_inline)) inline void lanes8_rows(const Lanes8BlockQ6& blk, const QRows& x, int64_t m,
                                                       int64_t b, float* accs) {
  const int64_t nb = x.K / kQK_K;
  const Rows8<R> in(x, m, b);
  const int8_t* const* a = in.a;
  const int16_t* const* ks = in.ks;
  __m256i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  for (int s = 0; s < 16; ++s) {
    const __m256i w0 = _mm256_load_si256(&blk.wd[4 * s]), w1 = _mm256_load_si256(&blk.wd[4 * s + 1]),
                  w2 = _mm256_load_si256(&blk.wd[4 * s + 2]), w3 = _mm256_load_si256(&blk.wd[4 * s + 3]);
    const __m256i sc = _mm256_load_si256(&blk.sc[s]);
    for (int r = 0; r < R; ++r) {
      const int8_t* v = a[r] + 16 * s;
#if defined(__AVXVNNI__)  // the group's 16 products less 32 sum(a) a lane in int32 (two chains), times its scale
      const __m256i offset = _mm256_set1_epi32(-32 * static_cast<int32_t>(ks[r][s]));
      const __m256i p = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(offset, w0, bcast4(v)), w1, bcast4(v + 4));
      const __m256i q = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w2, bcast4(v + 8)), w3,
                                                bcast4(v + 12));
      isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(p, q), sc));
#else
      const __m256i p01 =
          _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(v)), _mm256_maddubs_epi16(w1, bcast4(v + 4)));
      const __m256i p23 =
          _mm256_add_epi16(_mm256_maddubs_epi16(w2, bcast4(v + 8)), _mm256_maddubs_epi16(w3, bcast4(v + 12)));
      isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(p01, sc), _mm256_madd_epi16(p23, sc)));
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = m + r;
#if defined(__AVXVNNI__)
    const __m256i sum = isum[r];
#else
    __m256i off = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      int32_t pair;
      std::memcpy(&pair, ks[r] + 2 * t, 4);
      off = _mm256_add_epi32(off, _mm256_madd_epi16(_mm256_load_si256(&blk.scp[t]), _mm256_set1_epi32(pair)));
    }
    const __m256i sum = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
#endif
    float* acc = accs + r * kLanes8;
    _mm256_storeu_ps(acc, scaled_sum8(sum, blk.d, x.kd[row * nb + b], acc));
  }
}

#if defined(__AVXVNNI__)
// IQ4_XS's super-block of the tile's eight rows, decoded for AVX-VNNI's 256-bit `vpdpbusd` as qdot_lanes_iq4.h's 16
// lanes decode it (half the width): wd[8j + i] values 32j + 4i .. + 3 of each lane's row, kIQ4[q] + 128 (unsigned for
// `vpdpbusd`); sc[j] group j's scale (ls_j - 32) of each lane in int32; d. The same integers and float steps as those
// lanes, so the same bits. Without VNNI (the avx2 build) `vpmaddubsw` would saturate on the offset values, and the
// sign trick costs a lane what it costs the row loop (qdot_kquant.h's dot_iq4xs), which that build keeps.
struct Lanes8BlockIQ4 {
  __m256i wd[64];
  __m256i sc[8];
  __m256 d;
};

inline void decode_block8(const uint8_t* const p[kLanes8], int64_t at, Lanes8BlockIQ4& blk) {
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_xor_si128(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4)), _mm_set1_epi8(static_cast<char>(0x80))));
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int pair = 0; pair < 4; ++pair) {  // groups 2 pair and 2 pair + 1, 16 bytes each a row
    __m256i t[8];  // t[i]: dword i of the pair's 32 bytes; a byte's low nibble is value l, its high one l + 16
    for (int k = 0; k < kLanes8; ++k)
      t[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[k] + at + 8 + 32 * pair));
    transpose8_dwords(t);
    for (int i = 0; i < 8; ++i) {
      const int j = 2 * pair + i / 4, k = i % 4;
      _mm256_store_si256(&blk.wd[8 * j + k], _mm256_shuffle_epi8(table, _mm256_and_si256(t[i], low)));
      _mm256_store_si256(&blk.wd[8 * j + 4 + k],
                         _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(t[i], 4), low)));
    }
  }
  // each row's first 8 bytes: f16 d | scales_h << 16, then scales_l
  alignas(32) uint32_t head[2][kLanes8];
  for (int k = 0; k < kLanes8; ++k) std::memcpy(&head[0][k], p[k] + at, 4), std::memcpy(&head[1][k], p[k] + at + 4, 4);
  const __m256i dh = _mm256_load_si256(reinterpret_cast<const __m256i*>(head[0])),
                sl = _mm256_load_si256(reinterpret_cast<const __m256i*>(head[1]));
  const __m256i d16 = _mm256_and_si256(dh, _mm256_set1_epi32(0xFFFF));
  blk.d = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(d16), _mm256_extracti128_si256(d16, 1)));
  for (int j = 0; j < 8; ++j) {  // iq4xs_scale: low 4 bits from scales_l's nibble j, high 2 from scales_h's bits 2j
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(sl, 4 * j), _mm256_set1_epi32(0xF));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(dh, 16 + 2 * j), _mm256_set1_epi32(3));
    _mm256_store_si256(&blk.sc[j],
                       _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32)));
  }
}

// acc[r] (eight lanes) += activation row m + r's super-block b times the tile's decoded IQ4_XS super-block, r < R:
// qdot_lanes_iq4.h's sums (each group's started at -128 times its activations' sum, two chains, times its scale).
template <int R>
__attribute__((always_inline)) inline void lanes8_rows(const Lanes8BlockIQ4& blk, const QRows& x, int64_t m,
                                                       int64_t b, float* accs) {
  const int64_t nb = x.K / kQK_K;
  const Rows8<R> in(x, m, b);
  __m256i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    __m256i p[R];
    for (int r = 0; r < R; ++r)
      p[r] = _mm256_set1_epi32(-128 * (static_cast<int32_t>(in.ks[r][2 * j]) + in.ks[r][2 * j + 1]));
    vnni_group8<R>(&blk.wd[8 * j], in.a, 32 * j, p);
    const __m256i sc = _mm256_load_si256(&blk.sc[j]);
    for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(p[r], sc));
  }
  for (int r = 0; r < R; ++r) {
    float* acc = accs + r * kLanes8;
    _mm256_storeu_ps(acc, scaled_sum8(isum[r], blk.d, x.kd[(m + r) * nb + b], acc));
  }
}
#endif

// The scratch of format T's tile (one of lanes_k8's formats).
#if defined(__AVXVNNI__)
template <int T>
using Lanes8BlockOf = std::conditional_t<T == kQ4_K, Lanes8Block,
                                         std::conditional_t<T == kQ6_K, Lanes8BlockQ6, Lanes8BlockIQ4>>;
#else
template <int T>
using Lanes8BlockOf = std::conditional_t<T == kQ4_K, Lanes8Block, Lanes8BlockQ6>;
#endif

// out[m * ldo + n] = x[m] . W[n] (+ bias[n]) for n in [n_begin, n_end), m < M: lanes_tiles' loop, eight weight rows a
// tile, the tile kLanes8Ahead on prefetched into L2.
template <int T, typename O>
void qlinear_lanes_k8(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  static_assert(lanes_k8(T), "lanes_k8");
  using Block = Lanes8BlockOf<T>;
  const int64_t mt = std::max<int64_t>(T == kQ6_K ? 16 : 8, (64 << 10) / x.K);
  lanes_tiles<kLanes8, Block>(
      w, ldw, layout_of(T).bytes, x, M, n_begin, n_end, mt, kLanes8 * kLanes8Ahead, s,
      [](const uint8_t* const* p, int64_t at, Block& blk) { decode_block8(p, at, blk); },
      [&](const Block& blk, int64_t m, int64_t b, float* acc, auto r) {
        lanes8_rows<decltype(r)::value>(blk, x, m, b, acc);
      },
      [&](int64_t n, int64_t count, int64_t m0, int64_t m1, const float* accs) {
        const __m256i mask = lanes_below(count);
        const __m256 bv = bias ? _mm256_maskload_ps(bias + n, mask) : _mm256_setzero_ps();
        for (int64_t m = m0; m < m1; ++m) {
          alignas(32) float res[kLanes8];
          _mm256_store_ps(res, _mm256_add_ps(_mm256_loadu_ps(accs + (m - m0) * kLanes8), bv));
          for (int64_t k = 0; k < count; ++k) out[m * ldo + n + k] = static_cast<O>(res[k]);
        }
      });
}
#else
constexpr bool lanes_k8(int) { return false; }
template <int T, typename O>  // never called here (lanes_k8): declared for qlinear_rows' discarded branch
void qlinear_lanes_k8(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);
#endif

}  // namespace peregrine_quant
