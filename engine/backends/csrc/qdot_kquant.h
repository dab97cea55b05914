// qdot.h's loop for the K-quants (Q4_K, Q5_K, Q6_K) and IQ4_XS, as ggml's ggml_vec_dot_q4_K_q8_K / q5_K_q8_K /
// q6_K_q8_K / iq4_xs_q8_K compute them: the activations in blocks of 256 (one float scale each, and each 16 values'
// sum: QRows' kq / kd / ks), so a whole super-block of weights is summed in integers. Its group scales (6-bit Q4_K /
// Q5_K / IQ4_XS, int8 Q6_K)
// multiply the int16 pair sums of `vpmaddubsw` in `vpmaddwd` (where the other formats multiply by 1), Q6_K's offset
// of 32 multiplies the activation's 16-value sums in integers too, and one float FMA a super-block and activation row
// applies the two float scales (d * dx * isum); the minimums of Q4_K and Q5_K (dmin * mn, eight a block) take one
// more, with the activation's 32-value sums times dx (ksf). Q5_K is Q4_K with a fifth bit a value (qh), or'ed into
// the nibbles before the same integer dot. The per-32 design converted and multiplied each group: eight conversions
// and FMAs a super-block and row. Each activation row's sums are its own and in the same order whatever the number of
// rows (one to kRowsK a weight row at a time): batch invariant.
#pragma once

#include "qdot_packed.h"

namespace peregrine_quant {

// A Q4_K (or Q5_K) block's eight 6-bit scales (as int16, sc[0..7]) and minimums (as bytes, mn[0..7]): the portable
// build's (the AVX2 bodies take them in a register, q4k_scales_mins_x).
inline void q4k_scales_mins(const uint8_t* b, int16_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    uint8_t s, m;
    scale_min_k4(j, b + 4, &s, &m);
    sc[j] = s;
    mn[j] = m;
  }
}

#if defined(__AVX2__)
// A Q4_K (or Q5_K) block's eight scales and eight minimums in one register, as bytes (sc[0..7] in lanes 0-7,
// mn[0..7] in 8-15), unpacked by shuffles from one 16-byte load: no scalar steps, and no trip through memory, whose
// 4-byte stores a wider load cannot take forwarded (one row at K = 8192 on Zen 4: 269-270 against 282-285 ns).
// Scales 0-3 and minimums 0-3 are the low six bits of bytes 0-3 and 4-7; scales 4-7 the low nibbles of bytes 8-11
// with the top two bits of bytes 0-3 above, minimums 4-7 the high nibbles with the top bits of bytes 4-7 (ggml's
// get_scale_min_k4).
inline __m128i q4k_scales_mins_x(const uint8_t* b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // (and 4 bytes past them, unused)
  const __m128i low = _mm_and_si128(_mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7, -1, -1,
                                                                      -1, -1)),
                                    _mm_set1_epi8(63));
  const __m128i p = _mm_shuffle_epi8(x, _mm_setr_epi8(-1, -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i nib = _mm_and_si128(_mm_blend_epi16(p, _mm_srli_epi16(p, 4), 0xC0), _mm_set1_epi8(15));
  const __m128i q = _mm_shuffle_epi8(x, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i top = _mm_and_si128(_mm_srli_epi16(q, 2), _mm_set1_epi8(0x30));  // bits 6-7 to 4-5
  return _mm_or_si128(low, _mm_or_si128(nib, top));
}
#endif

// Group g's (0-7) 6-bit scale (q4k_scale) and minimum (q4k_min) of a Q4_K / Q5_K super-block for one row a 32-bit
// lane (the K-quant lanes, qdot_lanes8.h and qdot_lanes_k.h, at 256 and 512 bits): dw[c] holds dword c of each row's
// first 16 bytes (dw[1], dw[2] the low six bits of scales and minimums 0-3, dw[3] the nibbles of 4-7, bits 6-7 of
// dw[1], dw[2] their top bits: ggml's get_scale_min_k4, as q4k_scales_mins_x). `ops`: the width's and_, or_, srli32
// and set1_32.
template <typename V, typename Ops>
inline V q4k_scale(const V dw[4], int g, Ops ops) {
  if (g < 4) return ops.and_(ops.srli32(dw[1], 8 * g), ops.set1_32(63));
  return ops.or_(ops.and_(ops.srli32(dw[3], 8 * (g - 4)), ops.set1_32(15)),
                 ops.and_(ops.srli32(dw[1], 8 * (g - 4) + 2), ops.set1_32(0x30)));
}

template <typename V, typename Ops>
inline V q4k_min(const V dw[4], int g, Ops ops) {
  if (g < 4) return ops.and_(ops.srli32(dw[2], 8 * g), ops.set1_32(63));
  return ops.or_(ops.and_(ops.srli32(dw[3], 8 * (g - 4) + 4), ops.set1_32(15)),
                 ops.and_(ops.srli32(dw[2], 8 * (g - 4) + 2), ops.set1_32(0x30)));
}

// All eight of them: store(j, s_lo, s_hi, m_lo, m_hi) takes scales j and 4 + j and minimums j and 4 + j.
template <typename V, typename Ops, typename Store>
inline void q4k_scales_mins_lanes(const V dw[4], Ops ops, Store&& store) {
  for (int j = 0; j < 4; ++j)
    store(j, q4k_scale(dw, j, ops), q4k_scale(dw, 4 + j, ops), q4k_min(dw, j, ops), q4k_min(dw, 4 + j, ops));
}

// Asks for the `bytes` at p into L2 (prefetcht2), a line at a time: with p a super-block `fetch` bytes ahead of the
// one being multiplied, a row's stream is asked for a super-block at a time (qlinear_range_k's long rows).
inline void fetch_bytes(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
}

// The loop every K-quant dot shares: each activation row's accumulator (AVX2: eight float lanes) over the weight
// row's super-blocks, `block(blk, b, acc)` adding super-block b (its bytes at blk) into each row's acc[r] (portable:
// `block(blk, xb, acc)`, one activation row's float, xb its activation block), then each row's sum. `fetch` > 0:
// the bytes that many ahead of each super-block are asked for into L2 before it is multiplied.
template <int T, int R, typename Block>
inline void superblocks(const uint8_t* row, const QRows& x, int64_t m0, float* res, int64_t fetch, Block&& block) {
  constexpr int64_t bytes = layout_of(T).bytes;
  const int64_t nb = x.K / kQK_K;
#if defined(__AVX2__)
  (void)m0;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (fetch > 0) fetch_bytes(row + b * bytes + fetch, bytes);
    block(row + b * bytes, b, acc);
  }
  for (int r = 0; r < R; ++r) res[r] = hsum8(acc[r]);
#else
  (void)fetch;
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) block(row + b * bytes, (m0 + r) * nb + b, acc);
    res[r] = acc;
  }
#endif
}

#if defined(__AVX2__)
// Group g's fifth bits of a Q5_K block (bit g of each of its 32 qh bytes) as 16 in each byte: qh shifted so that bit
// g lands on bit 4, masked; a shift, an and (and the caller's or) a group. The 16-bit shifts carry bits across the
// byte boundary only below bit 4 (left) or above it (right), where the mask drops them.
inline __m256i fifths_k(__m256i qh, int g) {
  const __m256i m16 = _mm256_set1_epi8(0x10);
  if (g < 4) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - g), m16);
  if (g == 4) return _mm256_and_si256(qh, m16);
  return _mm256_and_si256(_mm256_srli_epi16(qh, g - 4), m16);
}
#endif

#if defined(__AVX2__)
// sum += p . s per pair of int16 lanes (p: `vpmaddubsw`'s pair sums, s: the groups' scales), in int32 lanes: VNNI's
// `vpdpwssd` where the build has it (one instruction for `vpmaddwd` and the add, the same integers).
inline __m256i scaled_add(__m256i sum, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(sum, p, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(sum, p, s);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(p, s));
#endif
}
#endif

// The AVX-512 build's Q4_K / Q5_K / Q6_K loops (AVX-512 BW): two 32-value groups in one 512-bit register (the lower
// group in the low 256 bits), multiplied with their 64 activations, which lie next to each other, in one `vpmaddubsw`
// and one `vpmaddwd`: half the instructions of the AVX2 body. Each row's int32 sums keep the lower groups' in the low
// lanes and the upper groups' in the high ones, folded into eight lanes (fold512) before the same float steps as the
// AVX2 body: the same integers, so bitwise its results. One thread, one activation row, L2-resident rows
// (scripts/bench_qdot.py), AMD EPYC Zen 4, against the AVX2 build: Q4_K 66.5-68.6 against 74.4-74.8 ns a row at
// K = 2048, Q5_K 79.4 against 88.2-88.4, Q6_K 71.1-71.5 against 81.5-83.3. IQ4_XS keeps the AVX2 body: without
// `vpsignb` its signed product took more instructions at 512 bits (92.3-95.3 against 84.1-85.1 ns).
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define PEREGRINE_KQ512 1
inline __m256i fold512(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// sum += (w . a per 16-bit pair) * s, the pair products' int16 sums times the groups' scales, in int32 lanes (with
// VNNI, `vpdpwssd` multiplies and adds in one instruction: the same integers; at 128 rows on Zen 4 the Q4_K matmuls
// 1.07-1.09x and the Q6_K ones 1.04-1.07x the GMAC/s of `vpmaddwd` and an add, scripts/bench_prefill.py).
inline __m512i dot_scaled(__m512i sum, __m512i w, const int8_t* a, __m512i s) {
  const __m512i p = _mm512_maddubs_epi16(w, _mm512_loadu_si512(a));
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sum, p, s);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(p, s));
#endif
}
#endif

// res[r] = x[m0 + r] . row for r < R, a Q4_K or Q5_K row: value 32j + l of a block is d * sc_j * q - dmin * mn_j
// (q 0-15; Q5_K's 0-31, a fifth bit from qh: bit j of qh[l] for group j), so a block's dot is
// d * dx * sum_j sc_j (q_j . a_j), its sum in integers, minus sum_j dmin * mn_j * (dx * sum(a_j)), eight float
// products (the weight row's minimums times the activation row's sums, ksf). Q5_K's unsigned values up to 31 keep
// `vpmaddubsw`'s pair sums (2 * 31 * 127) far from int16's saturation, as ggml_vec_dot_q5_K_q8_K does.
template <int T, int R>
inline void dot_q45k(const uint8_t* row, const QRows& x, int64_t m0, float* res, int64_t fetch) {
  static_assert(T == kQ4_K || T == kQ5_K);
  constexpr int qs = T == kQ5_K ? 48 : 16;  // where the nibbles start (Q5_K: after qh[32], at 16)
#if defined(__AVX2__)
  superblocks<T, R>(row, x, m0, res, fetch, [&](const uint8_t* blk, int64_t b, __m256* acc) {
    const int64_t K = x.K, nb = K / kQK_K;
    const __m128i scmn = q4k_scales_mins_x(blk);
    __m256i sumi[R];
    const __m256i qh = T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                                  : _mm256_setzero_si256();
#if defined(PEREGRINE_KQ512)
    // (no 256-bit halves put together: a lane-crossing insert each costs as much as it saves on CPUs that split
    // 512-bit operations in two, AMD Zen 4. The 32 bytes of nibbles are loaded into both halves and the high half
    // shifted; the scales are picked by one `vpshufb` from the eight in every 128-bit lane; Q5_K's fifth bits are
    // tested into a byte mask that adds 16.)
    __m512i sum2[R];
    for (int r = 0; r < R; ++r) sum2[r] = _mm512_setzero_si512();
    const __m512i sc4 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(scmn));
    const __m512i pick = _mm512_set_epi64(0x0302030203020302, 0x0302030203020302, 0x0302030203020302,
                                          0x0302030203020302, 0x0100010001000100, 0x0100010001000100,
                                          0x0100010001000100, 0x0100010001000100);  // words 0 (low half), 1 (high)
    const __m512i qh2 = _mm512_broadcast_i64x4(qh);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // groups 2j (the low nibbles, low half) and 2j + 1 (the high ones)
      const __m512i q =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qs + 32 * j)));
      __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF0000u, q, 4), _mm512_set1_epi8(0xF));
      if constexpr (T == kQ5_K) {
        const __m512i bit = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(static_cast<char>(1 << (2 * j))),
                                                    _mm512_set1_epi8(static_cast<char>(1 << (2 * j + 1))));
        w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh2, bit), w, _mm512_set1_epi8(0x10));
      }
      const __m512i s = _mm512_shuffle_epi8(sc4, _mm512_add_epi8(pick, _mm512_set1_epi8(static_cast<char>(4 * j))));
      for (int r = 0; r < R; ++r) sum2[r] = dot_scaled(sum2[r], w, x.kq + (m0 + r) * K + b * kQK_K + 64 * j, s);
    }
    for (int r = 0; r < R; ++r) sumi[r] = fold512(sum2[r]);
#else
    alignas(16) int16_t sc[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(sc), _mm_cvtepu8_epi16(scmn));
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // groups 2j (the low nibbles) and 2j + 1 (the high ones)
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qs + 32 * j)),
                    low = _mm256_set1_epi8(0xF);
      __m256i w0 = _mm256_and_si256(q, low), w1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      if constexpr (T == kQ5_K) {
        w0 = _mm256_or_si256(w0, fifths_k(qh, 2 * j));
        w1 = _mm256_or_si256(w1, fifths_k(qh, 2 * j + 1));
      }
      const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = x.kq + (m0 + r) * K + b * kQK_K + 64 * j;
        sumi[r] = scaled_add(
            sumi[r], _mm256_maddubs_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), s0);
        sumi[r] = scaled_add(
            sumi[r], _mm256_maddubs_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32))), s1);
      }
    }
#endif
    const __m256 d = _mm256_set1_ps(half_to_float(blk));
    const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(blk + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scmn, 8))));
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (m0 + r) * nb + b;
      acc[r] = madd8(_mm256_mul_ps(d, _mm256_broadcast_ss(x.kd + xb)), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
      acc[r] = madd8(mins, _mm256_loadu_ps(x.ksf + xb * 8), acc[r]);
    }
  });
#else
  superblocks<T, R>(row, x, m0, res, fetch, [&](const uint8_t* blk, int64_t xb, float& acc) {
    const int8_t* a = x.kq + xb * kQK_K;
    int16_t sc[8];
    uint8_t mn[8];
    q4k_scales_mins(blk, sc, mn);
    int32_t isum = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t p = 0;
      for (int l = 0; l < 32; ++l) {
        int32_t w = (blk[qs + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
        if constexpr (T == kQ5_K) w |= ((blk[16 + l] >> j) & 1) << 4;
        p += w * a[32 * j + l];
      }
      isum += sc[j] * p;
    }
    acc += half_to_float(blk) * x.kd[xb] * static_cast<float>(isum);
    const float dmin = half_to_float(blk + 2);
    for (int j = 0; j < 8; ++j) acc += -dmin * static_cast<float>(mn[j]) * x.ksf[xb * 8 + j];
  });
#endif
}

// res[r] = x[m0 + r] . row for r < R, a Q6_K row: value 16i + l of a block is d * sc_i * (q - 32), so a block's dot
// is d * dx * (sum_i sc_i (q_i . a_i) - 32 sum_i sc_i sum(a_i)), in integers (q unsigned, 0-63, for `vpmaddubsw`).
//
// Each super-block's sum is reduced to one int32 (exact) and added as fma(sum, d * dx, acc), one float chain a row:
// the float operations of Q6_K's lanes (qdot_lanes8.h, qdot_lanes_q6.h), so this loop and the lanes give a row the
// same bits and qlinear_rows may pick either by the number of activation rows (this one for one to three, where the
// lanes' transposes cost more than they share).
#if defined(__AVX2__)
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}
#endif

// Super-block b's (its bytes at blk) integer sums for activation rows m0 .. m0 + R - 1, eight int32 lanes each
// (the row's sum is theirs): sum_i sc_i (q_i . a_i) - 32 sum_i sc_i sum(a_i).
#if defined(__AVX2__)
template <int R>
inline void q6k_block_sums(const uint8_t* blk, const QRows& x, int64_t m0, int64_t b, __m256i* out) {
  const int64_t K = x.K, nb = K / kQK_K;
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
  __m256i sumi[R];
#if defined(PEREGRINE_KQ512)
  // groups 4n, 4n + 1 in one register (their low bits: l0's and l1's nibbles; their high bits: h's and h's shifted
  // by 2, h loaded into both halves), 4n + 2, 4n + 3 in another; the scales of their 16-value halves,
  // sc[8n .. 8n + 3] (then sc[8n + 4 ..]), one to each 128-bit lane, picked by `vpshufb` from half n's eight
  const __m512i pick = _mm512_set_epi64(0x0706070607060706, 0x0706070607060706, 0x0504050405040504,
                                        0x0504050405040504, 0x0302030203020302, 0x0302030203020302,
                                        0x0100010001000100, 0x0100010001000100);  // lane i: word i
  // (the high bits: groups 4n and 4n + 1 take bits 0-1 and 2-3 of h, h01's halves, to bits 4-5 by one shift
  // and a mask; groups 4n + 2, 4n + 3 bits 4-5 and 6-7, there already in h01's halves, by the mask alone; the
  // scales of half n: sc16's 128-bit half n, broadcast)
  __m512i sum2[R];
  for (int r = 0; r < R; ++r) sum2[r] = _mm512_setzero_si512();
  for (int n = 0; n < 2; ++n) {
    const __m512i l = _mm512_loadu_si512(blk + 64 * n), m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i h =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * n)));
    const __m512i h01 = _mm512_mask_srli_epi16(h, 0xFFFF0000u, h, 2);
    const __m512i w01 = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_slli_epi16(h01, 4), m30));
    const __m512i w23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_and_si512(h01, m30));
    const __m512i s8 =
        _mm512_broadcast_i32x4(n == 0 ? _mm256_castsi256_si128(sc16) : _mm256_extracti128_si256(sc16, 1));
    const __m512i s01 = _mm512_shuffle_epi8(s8, pick),
                  s23 = _mm512_shuffle_epi8(s8, _mm512_add_epi8(pick, _mm512_set1_epi8(8)));
    for (int r = 0; r < R; ++r) {
      const int8_t* a = x.kq + (m0 + r) * K + b * kQK_K + 128 * n;
      sum2[r] = dot_scaled(dot_scaled(sum2[r], w01, a, s01), w23, a + 64, s23);
    }
  }
  for (int r = 0; r < R; ++r) sumi[r] = fold512(sum2[r]);
#else
  // each group's two scales as int16 (one for each 16 values), picked from the 16 int8 ones by a shuffle and
  // widened: two instructions, not two broadcasts from memory and an insert
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
  for (int n = 0; n < 2; ++n) {  // a half: 128 values, groups 4n .. 4n + 3 of 32
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * n)),
                  l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * n + 32)),
                  h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * n)),
                  m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    const __m256i low[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                            _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
    // group g's two high bits (bits 2g, 2g + 1 of h) moved to bits 4-5 by one shift and masked: the 16-bit shifts
    // carry bits across the byte boundary only into bits the mask drops
    const __m256i high[4] = {_mm256_and_si256(_mm256_slli_epi16(h, 4), m30),
                             _mm256_and_si256(_mm256_slli_epi16(h, 2), m30), _mm256_and_si256(h, m30),
                             _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)};
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const int j = 4 * n + g;
      const __m256i w = _mm256_or_si256(low[g], high[g]);
      const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_add_epi8(pick, _mm_set1_epi8(2 * j))));
      for (int r = 0; r < R; ++r) {
        const int8_t* a = x.kq + (m0 + r) * K + b * kQK_K + 32 * j;
        sumi[r] =
            scaled_add(sumi[r], _mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), s);
      }
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    const int64_t xb = (m0 + r) * nb + b;
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ks + xb * 16));
    const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, s16), 5);  // 32 sum_i sc_i sum(a_i)
    out[r] = _mm256_sub_epi32(sumi[r], offset);
  }
}

// The sums of a's lanes and of b's, in lanes 0 and 1 (and again in 2 and 3): two reductions' shuffles shared (one
// activation row, two super-blocks at a time: half the instructions of two hsum8_epi32).
inline __m128i hsum2_epi32(__m256i a, __m256i b) {
  const __m256i t = _mm256_hadd_epi32(a, b);  // a01 a23 b01 b23 | a45 a67 b45 b67
  const __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  return _mm_hadd_epi32(u, u);
}
#endif

template <int R>
inline void dot_q6k(const uint8_t* row, const QRows& x, int64_t m0, float* res, int64_t fetch) {
#if defined(__AVX2__)
  constexpr int64_t bytes = layout_of(kQ6_K).bytes;
  const int64_t nb = x.K / kQK_K;
  float acc[R] = {};
  auto dk = [&](int r, int64_t b) { return half_to_float(row + b * bytes + 208) * x.kd[(m0 + r) * nb + b]; };
  int64_t b = 0;
  if constexpr (R == 1)
    for (; b + 2 <= nb; b += 2) {
      if (fetch > 0) fetch_bytes(row + b * bytes + fetch, 2 * bytes);
      __m256i v0, v1;
      q6k_block_sums<1>(row + b * bytes, x, m0, b, &v0);
      q6k_block_sums<1>(row + (b + 1) * bytes, x, m0, b + 1, &v1);
      const __m128 f = _mm_cvtepi32_ps(hsum2_epi32(v0, v1));  // (the conversion of static_cast<float>)
      acc[0] = std::fma(_mm_cvtss_f32(f), dk(0, b), acc[0]);
      acc[0] = std::fma(_mm_cvtss_f32(_mm_movehdup_ps(f)), dk(0, b + 1), acc[0]);
    }
  for (; b < nb; ++b) {
    if (fetch > 0) fetch_bytes(row + b * bytes + fetch, bytes);
    __m256i v[R];
    q6k_block_sums<R>(row + b * bytes, x, m0, b, v);
    for (int r = 0; r < R; ++r) acc[r] = std::fma(static_cast<float>(hsum8_epi32(v[r])), dk(r, b), acc[r]);
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r];
#else
  superblocks<kQ6_K, R>(row, x, m0, res, fetch, [&](const uint8_t* blk, int64_t xb, float& acc) {
    const int8_t* a = x.kq + xb * kQK_K;
    int32_t isum = 0;
    for (int i = 0; i < 16; ++i) {
      const int j = i / 2, n = j / 4, g = j % 4;
      int32_t p = 0;
      for (int l = 16 * (i % 2); l < 16 * (i % 2) + 16; ++l) {
        const int low = (blk[64 * n + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0xF,
                  high = (blk[128 + 32 * n + l] >> (2 * g)) & 3;
        p += (low | (high << 4)) * a[32 * j + l];
      }
      isum += static_cast<int8_t>(blk[192 + i]) * (p - 32 * x.ks[xb * 16 + i]);
    }
    acc += half_to_float(blk + 208) * x.kd[xb] * static_cast<float>(isum);
  });
#endif
}

// res[r] = x[m0 + r] . row for r < R, an IQ4_XS row: value 32j + l of a block is d * ls_j * kIQ4[q] (ls_j the
// group's signed 6-bit scale, iq4xs_scale), so a block's dot is d * dx * sum_j ls_j (w_j . a_j) in integers, as
// ggml_vec_dot_iq4_xs_q8_K: the table's values by one `vpshufb` of the nibbles (qdot_formats.h), signed times signed
// by the sign trick (|w| times a with w's sign; |w| <= 127, so the pair sums stay below int16's saturation), the
// group's scale by `vpmaddwd`. The AVX-512 VNNI builds take IQ4_XS through lanes of their own (qdot_lanes_iq4.h),
// in their own order of float sums.
template <int R>
inline void dot_iq4xs(const uint8_t* row, const QRows& x, int64_t m0, float* res, int64_t fetch) {
#if defined(__AVX2__)
  superblocks<kIQ4_XS, R>(row, x, m0, res, fetch, [&](const uint8_t* blk, int64_t b, __m256* acc) {
    const int64_t K = x.K, nb = K / kQK_K;
    const __m256i table = iq4_table();
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_shuffle_epi8(table, nibbles16(blk + 8 + 16 * j)), wu = _mm256_sign_epi8(w, w);
      const __m256i s = _mm256_set1_epi16(static_cast<int16_t>(iq4xs_scale(blk, j)));
      for (int r = 0; r < R; ++r) {
        const int8_t* ar = x.kq + (m0 + r) * K + b * kQK_K + 32 * j;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar));
        sumi[r] = scaled_add(sumi[r], _mm256_maddubs_epi16(wu, _mm256_sign_epi8(a, w)), s);
      }
    }
    const __m256 d = _mm256_set1_ps(half_to_float(blk));
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (m0 + r) * nb + b;
      acc[r] = madd8(_mm256_mul_ps(d, _mm256_broadcast_ss(x.kd + xb)), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
  });
#else
  superblocks<kIQ4_XS, R>(row, x, m0, res, fetch, [&](const uint8_t* blk, int64_t xb, float& acc) {
    const int8_t* a = x.kq + xb * kQK_K;
    int32_t isum = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t p = 0;
      for (int l = 0; l < 32; ++l)
        p += kIQ4[(blk[8 + 16 * j + l % 16] >> (4 * (l / 16))) & 0xF] * a[32 * j + l];
      isum += iq4xs_scale(blk, j) * p;
    }
    acc += half_to_float(blk) * x.kd[xb] * static_cast<float>(isum);
  });
#endif
}

// (fetch: the prefetch distance of superblocks, 0 for none.)
template <int T, int R>
inline void dot_k(const uint8_t* row, const QRows& x, int64_t m0, float* res, int64_t fetch = 0) {
  if constexpr (T == kQ6_K)
    dot_q6k<R>(row, x, m0, res, fetch);
  else if constexpr (T == kIQ4_XS)
    dot_iq4xs<R>(row, x, m0, res, fetch);
  else
    dot_q45k<T, R>(row, x, m0, res, fetch);
}

// Activation rows a weight row meets at a time (dot_k's R) in qlinear_range_k: eight in the AVX-512 build's K-quant
// loops, whose 32 registers hold eight rows' sums (the weights' unpacking then shared by twice the rows: a 128-token
// prefill step of Llama-3.2-1B Q4_K_M 1.13x faster on Zen 4, scripts/bench_prefill.py; sixteen spilled and was
// slower), four elsewhere (AVX2's 16 registers). Each row's sums are its own whatever R.
#if defined(PEREGRINE_KQ512)
constexpr int kRowsK = 8;
#else
constexpr int kRowsK = 4;
#endif

// qlinear_range_k's tiles, in bytes: the activation rows (int8, K bytes each) each weight row meets before the next
// weight row (L1), and the weight rows that meet every such tile of activation rows before the next block of them
// (L2). A 128-row prefill chunk's activations (256 KiB at K = 2048, 1 MiB at K = 8192) do not stay in L1 or L2
// otherwise. One thread, AMD EPYC Zen 3, M = 128 (CPU time, the best of 9, a loaded machine):
// Q4_K [2048, 2048] 36.0-37.9 against 35.4-35.9 GMAC/s untiled, Q6_K [1024, 8192] 38.8-39.2 against 32.9-34.9.
// Half of a 32 KiB L1 for the activations, as the weight rows stream through it too: 16 rows of K = 2048 in 32 KiB
// were 1.22x slower than two tiles of eight (Q4_K, 535 against 437 ns a weight row, scripts/bench_qdot.py --rows 16,
// AMD EPYC Zen 4).
constexpr int64_t kActTileBytes = 16 << 10, kWeightTileBytes = 128 << 10;

// out[m * ldo + n] = x[m] . W[n] (+ bias[n]) for n in [n_begin, n_end), m < M, W a K-quant's rows (`ldw` bytes
// apart), in tiles: a block of weight rows (kWeightTileBytes, in L2) against a block of activation rows at a time
// (kActTileBytes, in L1), each weight row with up to kRowsK activation rows at a time, the next weight rows
// prefetched in the first block of activation rows. A row's result does not depend on the tile it falls in: each
// goes through dot_k, whose sums are the same whatever R.
// The rows ahead are asked for into L2 (prefetcht2), not L1, where a whole row at a time (1.7-6.7 KB for Q6_K)
// competed with the row in use for the L1 and its miss buffers. Q6_K rows from memory, one activation row, two
// threads (AMD EPYC Zen 4, each figure the best of 7 over weights on huge pages four times the L3, three rounds
// alternating, GB/s):
// [16384, 2048] 33.8 / 41.7 / 33.0 -> 49.8 / 48.6 / 38.1, [2048, 8192] 24.0 / 26.4 / 23.9 -> 28.5 / 27.3 / 28.3; the
// avx2 build 32.5 / 24.9 / 33.0 -> 45.8 / 46.7 / 37.4 and 22.5 / 22.7 / 23.7 -> 27.3 / 24.0 / 24.8.
// At one activation row, rows of kSpreadRowBytes or more (Q6_K's at K = 8192: 6.7 KB, four rows ahead 27 KB) are
// asked for a super-block at a time, kSpreadAhead bytes ahead, inside the dot (fetch_bytes), not a row at a time:
// Q6_K [2048, 8192] from memory, same conditions, eight rounds alternating in one build: 20.1-24.4 -> 26.9-29.7
// GB/s; rows of K = 2048 stayed a row at a time (24.8-29.0 spread, against 26.3-34.6).
constexpr int64_t kSpreadRowBytes = 4096, kSpreadAhead = 4096;
template <int T, typename O>
void qlinear_range_k(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                     int64_t ldo, int64_t n_begin, int64_t n_end) {
  const int64_t ahead = prefetch_rows(ldw, M, 4096);
  const int64_t spread = M == 1 && ldw >= kSpreadRowBytes ? kSpreadAhead : 0;  // (bytes ahead; 0: rows ahead)
  const int64_t mt = std::max<int64_t>(kRowsK, kActTileBytes / x.K / 4 * 4);
  const int64_t nt = M <= mt ? n_end - n_begin : std::max<int64_t>(4, kWeightTileBytes / ldw);
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += nt) {
    const int64_t n1 = std::min(n_end, n0 + nt);
    for (int64_t m0 = 0; m0 < M; m0 += mt) {
      const int64_t m1 = std::min(M, m0 + mt);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * ldw;
        if (m0 == 0 && n + ahead < n_end && !spread)
          for (int64_t o = 0; o < ldw; o += 64) __builtin_prefetch(row + ahead * ldw + o, 0, 1);  // into L2
        const float bn = bias ? bias[n] : 0.f;
        float res[kRowsK];
        int64_t m = m0;
        auto put = [&](int count) {
          for (int r = 0; r < count; ++r) out[(m + r) * ldo + n] = static_cast<O>(res[r] + bn);
          m += count;
        };
        if constexpr (kRowsK == 8 && T != kIQ4_XS)  // (IQ4_XS keeps the 256-bit body: four)
          while (m + 8 <= m1) dot_k<T, 8>(row, x, m, res), put(8);
        while (m + 4 <= m1) dot_k<T, 4>(row, x, m, res), put(4);
        if (m + 2 <= m1) dot_k<T, 2>(row, x, m, res), put(2);
        if (m < m1) dot_k<T, 1>(row, x, m, res, n * ldw + spread < n_end * ldw ? spread : 0), put(1);
      }
    }
  }
}

// The tile loop of the lanes that decode a weight tile's super-block once into scratch (qdot_lanes8.h, W = 8 rows a
// tile; qdot_lanes_q6.h, 16): tiles of W weight rows (the last tile's missing rows standing in as its last row, not
// stored), each super-block decoded once (`decode(p, at, blk)`) for a block of up to `mt` activation rows, which
// `rows(blk, m, b, acc, R)` adds to their W accumulators in scratch four, two and one at a time; `store(n, count,
// m0, m1, accs)` writes the tile's results for the block's rows. Blocks of weight rows that stay in L2 against
// blocks of activation rows when M is large; the tile `ahead` rows on prefetched into L2 in the first block of
// activation rows, a share a super-block.
template <int W, typename Block, typename Decode, typename Rows, typename Store>
void lanes_tiles(const uint8_t* w, int64_t ldw, int64_t block_bytes, const QRows& x, int64_t M, int64_t n_begin,
                 int64_t n_end, int64_t mt, int64_t ahead, QScratch& s, Decode&& decode, Rows&& rows, Store&& store) {
  constexpr uintptr_t align = alignof(Block);
  const int64_t nb = x.K / kQK_K;
  const int64_t nt = M <= mt ? n_end - n_begin : std::max<int64_t>(W, kWeightTileBytes / ldw / W * W);
  const int64_t floats = static_cast<int64_t>(sizeof(Block) + align) / 4 + std::min(M, mt) * W;
  if (static_cast<int64_t>(s.sc.size()) < floats) s.sc.resize(floats);
  auto* blk = reinterpret_cast<Block*>((reinterpret_cast<uintptr_t>(s.sc.data()) + align - 1) & ~(align - 1));
  float* accs = reinterpret_cast<float*>(blk + 1);
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += nt) {
    const int64_t n1 = std::min(n_end, n0 + nt);
    for (int64_t m0 = 0; m0 < M; m0 += mt) {
      const int64_t m1 = std::min(M, m0 + mt);
      for (int64_t n = n0; n < n1; n += W) {
        const int64_t count = std::min<int64_t>(W, n1 - n);
        const uint8_t* p[W];
        for (int k = 0; k < W; ++k) p[k] = w + (n + std::min<int64_t>(k, count - 1)) * ldw;
        const int64_t fetch_begin = std::min(n_end, n + ahead) * ldw;
        const int64_t fetch_bytes = m0 == 0 ? std::min(n_end, n + ahead + W) * ldw - fetch_begin : 0;
        const int64_t step = (fetch_bytes / nb + 63) / 64 * 64;
        for (int64_t i = 0; i < (m1 - m0) * W; ++i) accs[i] = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          for (int64_t o = b * step; o < std::min(fetch_bytes, (b + 1) * step); o += 64)
            __builtin_prefetch(w + fetch_begin + o, 0, 1);
          decode(p, b * block_bytes, *blk);
          int64_t m = m0;
          for (; m + 4 <= m1; m += 4) rows(*blk, m, b, accs + (m - m0) * W, std::integral_constant<int, 4>{});
          if (m + 2 <= m1) rows(*blk, m, b, accs + (m - m0) * W, std::integral_constant<int, 2>{}), m += 2;
          if (m < m1) rows(*blk, m, b, accs + (m - m0) * W, std::integral_constant<int, 1>{});
        }
        store(n, count, m0, m1, accs);
      }
    }
  }
}

}  // namespace peregrine_quant
