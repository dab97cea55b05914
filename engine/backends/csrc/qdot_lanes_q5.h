// Q5_0 rows (the file's 22-byte blocks: f16 d, 32 fifth bits, 16 bytes of nibbles) in the AVX-512 VNNI builds,
// sixteen weight rows at a time, one a 32-bit lane, as qdot_lanes.h does for the packed formats. Files quantized to
// Q4_K_M whose rows are not a multiple of 256 (Gemma-3-1B's 1,152) hold most of their matrices as Q5_0. Two groups'
// 16 bytes of nibbles a row are transposed in registers (lane j: row j's four bytes: values 4i .. 4i + 3 in the low
// nibbles, 16 + 4i .. in the high ones); each lane's fifth bits, read once a tile with its scales (no gathers), are
// added four at a time as 16 (a byte shuffle, a bit test and a masked add); `vpdpbusd` against broadcast activation
// dwords, a group's conversion, scale and FMA for 16 rows, the offset of 16 a minimum of -16 d, as Q4_0's. Each lane
// is its own row's sequence of operations: the same bits for a row in any batch, lane or tile; not the row loop's bits
// (a different order of float sums). Rows of a multiple of 64 values (pairs of groups); others keep the row loop.
// scripts/bench_qdot.py --format Q5_0, one thread, rows in L2, AMD EPYC Zen 4, ns a weight row at K = 1152 (6912),
// against the row loop: 1 activation row 41 (271) against 68 (365), 4 rows 64 (455) against 126 (767), 16 rows 219
// (1515) against 429 (2688); from memory, one row of 131072 x 1152 on 2 threads, 3.62-3.73 against 4.58-4.60 ms
// (before the tile's scales were loaded without gathers: 1 row 55 (348), 4 rows 79 (539), 16 rows 242 (1594)).
#pragma once

#include "qdot_lanes.h"

namespace peregrine_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
constexpr bool lanes_q5(int T) { return T == kQ5_0; }

// The tile's d, -16 d and fifth bits for every group, lane j row j's: sd[g * 16 + j], sm[...], qh[...]. Each row's
// first eight bytes of a group (f16 d, the 32 fifth bits, two bytes of nibbles) loaded as one integer, two rows to a
// 128-bit register, eight rows to a 512-bit one: no gather (32 elements a group in two 32-bit gathers, about a cycle
// an element on Zen 4, and slower still on the Xeons whose microcode guards gathers against Downfall).
inline void tile_scales_q5(const uint8_t* const p[kLanes], int64_t groups, float* sd, float* sm, uint32_t* qh) {
  constexpr int64_t bytes = 22;
  const __m512 sixteen = _mm512_set1_ps(-16.f);
  for (int64_t g = 0; g < groups; ++g) {
    auto two = [&](int k) {  // rows k and k + 1
      int64_t u, v;
      std::memcpy(&u, p[k] + g * bytes, 8);
      std::memcpy(&v, p[k + 1] + g * bytes, 8);
      return _mm_set_epi64x(v, u);
    };
    auto eight = [&](int k) {  // rows k .. k + 7, one a 64-bit lane
      return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(two(k + 2), two(k))),
                                _mm256_set_m128i(two(k + 6), two(k + 4)), 1);
    };
    const __m512i a = eight(0), b = eight(8);
    const __m512 d = _mm512_cvtph_ps(_mm256_set_m128i(_mm512_cvtepi64_epi16(b), _mm512_cvtepi64_epi16(a)));
    const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_srli_epi64(a, 16))),
                                         _mm512_cvtepi64_epi32(_mm512_srli_epi64(b, 16)), 1);
    _mm512_storeu_ps(sd + g * kLanes, d);
    _mm512_storeu_ps(sm + g * kLanes, _mm512_mul_ps(sixteen, d));
    _mm512_storeu_si512(qh + g * kLanes, h);
  }
}

// v (each byte a value's low four bits) with 16 added to the bytes whose fifth bit is set: value j of byte j of
// each lane is bit S + j of the lane's qh (S = 4i for values 4i .., 16 + 4i for 16 + 4i ..). `vpshufb` copies qh's
// byte S / 8 into the lane's four bytes, `vptestmb` picks bit S % 8 + j of byte j, a masked add puts the 16 in.
template <int S>
inline __m512i with_fifths(__m512i v, __m512i qh) {
  const __m512i pick = _mm512_add_epi8(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0),
                                       _mm512_set1_epi8(static_cast<char>(S / 8)));
  const __m512i bits = _mm512_set1_epi32(static_cast<int>(0x08040201u << (S % 8)));
  const __mmask64 set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, pick), bits);
  return _mm512_mask_add_epi8(v, set, v, _mm512_set1_epi8(16));
}

// Group g's 32 values of the 16 rows from t (t[i], i < 4, bytes 4i .. 4i + 3 of its nibbles): w[i] values 4i ..,
// w[4 + i] values 16 + 4i ...
inline void values_q5(const __m512i* t, __m512i qh, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0xF);
  w[0] = with_fifths<0>(_mm512_and_si512(t[0], low), qh);
  w[1] = with_fifths<4>(_mm512_and_si512(t[1], low), qh);
  w[2] = with_fifths<8>(_mm512_and_si512(t[2], low), qh);
  w[3] = with_fifths<12>(_mm512_and_si512(t[3], low), qh);
  w[4] = with_fifths<16>(_mm512_and_si512(_mm512_srli_epi16(t[0], 4), low), qh);
  w[5] = with_fifths<20>(_mm512_and_si512(_mm512_srli_epi16(t[1], 4), low), qh);
  w[6] = with_fifths<24>(_mm512_and_si512(_mm512_srli_epi16(t[2], 4), low), qh);
  w[7] = with_fifths<28>(_mm512_and_si512(_mm512_srli_epi16(t[3], 4), low), qh);
}

// A pair of groups (g, g + 1) of the 16 rows times activation rows m0 .. m0 + R - 1, into acc and macc: t[i], i < 4,
// group g's nibble bytes 4i .. 4i + 3 in lane j (row j's), t[4 + i] group g + 1's; qh, d and -16 d of each group in
// lane j. Both layouts (the file's rows, the tiled form) come here: the same operations, the same bits.
template <int R>
__attribute__((always_inline)) inline void pair_q5(const __m512i t[8], __m512i qh0, __m512i qh1, __m512 d0, __m512 d1,
                                                   __m512 m0v, __m512 m1v, const QRows& x, int64_t m0, int64_t g,
                                                   __m512 acc[R][2], __m512 macc[R]) {
  __m512i w0[8], w1[8];
  values_q5(t, qh0, w0);
  values_q5(t + 4, qh1, w1);
  pair_rows<R>(w0, w1, d0, d1, m0v, m1v, x, m0, g, acc, macc);
}

// The pairs of groups of a row length, each after prefetching its share of the `fetch_bytes` at `fetch` (the tile
// kLanesAhead on, into L2), then `pair(g, acc, macc)`; res[r] the sums.
template <int R, typename F>
__attribute__((always_inline)) inline void pairs_q5(int64_t groups, const uint8_t* fetch, int64_t fetch_bytes,
                                                    __m512* res, F&& pair) {
  __m512 acc[R][2], macc[R];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = macc[r] = _mm512_setzero_ps();
  const int64_t step = (fetch_bytes / (groups / 2) + 63) / 64 * 64;  // the lines to fetch a pair
  for (int64_t g = 0; g < groups; g += 2) {
    for (int64_t o = (g / 2) * step; o < std::min(fetch_bytes, (g / 2 + 1) * step); o += 64)
      __builtin_prefetch(fetch + o, 0, 1);  // into L2 (prefetcht2)
    pair(g, acc, macc);
  }
  for (int r = 0; r < R; ++r) res[r] = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), macc[r]);
}

// res[r] (16 lanes) = activation row m0 + r times the tile's 16 Q5_0 rows (the file's), r < R.
template <int R>
inline void lanes_block_q5(const uint8_t* const p[kLanes], const float* sd, const float* sm, const uint32_t* qh,
                           const QRows& x, int64_t m0, __m512* res, const uint8_t* fetch = nullptr,
                           int64_t fetch_bytes = 0) {
  constexpr int64_t bytes = 22;
  pairs_q5<R>(x.K / kQK, fetch, fetch_bytes, res, [&](int64_t g, __m512 acc[R][2], __m512 macc[R]) {
    __m512i t[8];
    auto nib = [&](int k, int64_t gg) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[k] + gg * bytes + 6));
    };
    for (int k = 0; k < 8; ++k) {  // row k: group g's 16 bytes, then g + 1's; row k + 8's above
      const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(nib(k, g)), nib(k, g + 1), 1);
      const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(nib(k + 8, g)), nib(k + 8, g + 1), 1);
      t[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    transpose_dwords(t);  // t[i], i < 4: group g's bytes 4i .. 4i + 3; t[4 + i]: group g + 1's
    pair_q5<R>(t, _mm512_loadu_si512(qh + g * kLanes), _mm512_loadu_si512(qh + (g + 1) * kLanes),
               _mm512_loadu_ps(sd + g * kLanes), _mm512_loadu_ps(sd + (g + 1) * kLanes),
               _mm512_loadu_ps(sm + g * kLanes), _mm512_loadu_ps(sm + (g + 1) * kLanes), x, m0, g, acc, macc);
  });
}

// lanes_block_q5 for a tile of the tiled form (quant.h: kQ5_0T; t its first byte): each group's 352 bytes hold the
// 16 rows' fifth bits (lane j row j's), their nibbles as transpose_dwords leaves them and their f16 d, so a pair of
// groups is ten loads and two conversions; -16 d is computed as tile_scales_q5 does (the same bits).
template <int R>
inline void tile_block_q5(const uint8_t* t, const QRows& x, int64_t m0, __m512* res, const uint8_t* fetch,
                          int64_t fetch_bytes) {
  constexpr int64_t group = kLanes * 22;
  const __m512 sixteen = _mm512_set1_ps(-16.f);
  pairs_q5<R>(x.K / kQK, fetch, fetch_bytes, res, [&](int64_t g, __m512 acc[R][2], __m512 macc[R]) {
    const uint8_t* a = t + g * group;
    const uint8_t* b = a + group;
    auto at = [](const uint8_t* q, int i) { return _mm512_loadu_si512(q + 64 * i); };
    const __m512i v[8] = {at(a, 1), at(a, 2), at(a, 3), at(a, 4), at(b, 1), at(b, 2), at(b, 3), at(b, 4)};
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 320)));
    const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 320)));
    pair_q5<R>(v, at(a, 0), at(b, 0), d0, d1, _mm512_mul_ps(sixteen, d0), _mm512_mul_ps(sixteen, d1), x, m0, g, acc,
               macc);
  });
}

// qlinear_tiles (qdot_lanes.h) for tiled Q5_0 (quant.h: kQ5_0T; rows of a multiple of 64 values): each tile that
// meets [n_begin, n_end) multiplied whole, its lanes in the range stored.
template <typename O>
void qlinear_tiles_q5(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end) {
  tiles_in(w, ldw, M, bias, out, ldo, n_begin, n_end, [&](const uint8_t* const p[kLanes], int64_t m, auto rr,
                                                         __m512* res, const uint8_t* fetch, int64_t fetch_bytes) {
    tile_block_q5<decltype(rr)::value>(p[0], x, m, res, fetch, fetch_bytes);
  });
}

template <int T, typename O>
void qlinear_lanes_q5(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  static_assert(T == kQ5_0, "lanes_q5");
  const int64_t K = x.K, groups = K / kQK;
  const int64_t per = (groups + 2) * kLanes;
  if (static_cast<int64_t>(s.sc.size()) < 3 * per) s.sc.resize(3 * per);
  float *sd = s.sc.data(), *sm = sd + per;
  uint32_t* qh = reinterpret_cast<uint32_t*>(sm + per);
  const int64_t ahead = kLanes * kLanesAhead;  // rows
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end; n += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n_end - n);
    const uint8_t* p[kLanes];
    for (int j = 0; j < kLanes; ++j) p[j] = w + (n + std::min<int64_t>(j, count - 1)) * ldw;
    const int64_t fetch_begin = std::min(n_end, n + ahead) * ldw;  // the tile `ahead` rows on
    const int64_t fetch_bytes = std::min(n_end, n + ahead + kLanes) * ldw - fetch_begin;
    tile_scales_q5(p, groups, sd, sm, qh);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    __m512 res[kLaneRowsR];
    auto block = [&](int64_t m, auto rr) {
      constexpr int RR = decltype(rr)::value;
      if (m == 0)
        lanes_block_q5<RR>(p, sd, sm, qh, x, m, res, w + fetch_begin, fetch_bytes);
      else
        lanes_block_q5<RR>(p, sd, sm, qh, x, m, res);
      for (int r = 0; r < RR; ++r) store_lanes(out + (m + r) * ldo + n, _mm512_add_ps(res[r], b), count, mask);
    };
    row_blocks(M, block);
  }
}
#else
constexpr bool lanes_q5(int) { return false; }
template <int T, typename O>  // never called here (lanes_q5): declared for qlinear_rows' discarded branch
void qlinear_lanes_q5(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);
template <typename O>  // likewise
void qlinear_tiles_q5(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end);
#endif

}  // namespace peregrine_quant
