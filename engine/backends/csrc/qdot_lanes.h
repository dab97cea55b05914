// Row-packed Q4_0 / Q4_1 / Q8_0 (quant.h: kQ4_0R / kQ4_1R / kQ8_0R) in the AVX-512 VNNI builds: sixteen weight rows
// at a time, one row a 32-bit lane. dot_packed (qdot_packed.h) gives each (weight row, activation row) a 512-bit dot
// of 64 weights, then a scale permute, a conversion and an FMA of its own: four vector operations for 64 products,
// whatever the number of activation rows. Here the 32-byte pairs of groups of 16 rows are transposed in registers
// (lane j: row j's four bytes; 24 shuffles for 16 rows), so a `vpdpbusd` against one broadcast activation dword adds
// four products to each of the 16 rows, and a group's conversion, scale and FMA serve 16 rows at once: 16 `vpdpbusd`
// and 6 float operations for 16 rows x 64 weights and an activation row, the transpose shared by up to four
// activation rows.
//
// Each lane is one weight row's own sequence of operations (its group sums exact in int32, then acc = fma(sum,
// d_w * d_a, acc) group by group, two chains: even and odd groups, the minimums in a third), so a row's result is
// the same bits whatever its tile, lane, thread split or number of activation rows (batch invariant). They are not
// dot_packed's bits (a different order of float sums): the AVX-512 builds use this loop for every number of rows.
// scripts/bench_qdot.py, packed Q4_1, one thread, rows in L2, AMD EPYC Zen 4, ns a weight row (dot_packed's in
// brackets): K = 576, 1 activation row 15.7-16.0 (17.5-17.8), 2 rows 18.5 (33.7), 4 rows 25.5-25.7 (66.6-68.3),
// 16 rows 83-86 (222-240); K = 2048, 1 row 53-54 (51-52), 16 rows 299-304 (629-670).
// Packed Q8_0 takes each group's 32 bytes of 16 rows through the same transpose (its values flipped to q + 128, as
// dot_packed takes them): 48 shuffles a pair of groups instead of 24, no nibbles to split. Packed Q8_0, K = 576
// (2048): 1 row 18.3 (60.7) ns against dot_packed's 16.5 (48.3), 4 rows 31.2 (106) against 72 (160), 16 rows 107
// (365) against 238 (597); from memory (a 65536 x 2048 matrix, 2 threads) one row 5.0 ms against 6.2 (the tiles
// prefetched into L2, below), 16 rows 13.8 against 26.4.
// Tiled weights (quant.h: kQ4_0T / kQ4_1T / kQ8_0T; qlinear_tiles) hold each tile as the transpose leaves it: the
// same loop loads it front to back with no shuffles, the scale columns as they lie (one activation row of packed
// Q4_1 in L2 1.9x faster on an Intel Xeon with AMX; docs/benchmarks.md, "Tiled weights for the 16-lane loops").
#pragma once

#include "qdot_packed.h"

#include "amx_tiles.h"

namespace peregrine_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
constexpr bool lanes_packed(int T) { return T == kQ4_0R || T == kQ4_1R || T == kQ8_0R; }
static_assert(kUnsignedQ8, "packed Q8_0 goes through the lanes as q + 128, its minimums -128 d");
// Up to kLaneRowsR activation rows share a transpose (row_blocks; the 16 decoded weight registers and each row's
// four int32 sums stay in registers, the rows' float accumulators, touched once a pair of groups, need not).
// scripts/bench_qdot.py, one thread, rows in L2, Intel Xeon with AVX-512 VNNI and AMX (avx512_bf16 build), ns a
// weight row, blocks of at most 4 rows (9 rows: 4 + 4 + 1) against at most 8 (9 rows: 5 + 4), two rounds
// alternating: packed Q4_1 K = 576, 16 rows 101-105 -> 90; packed Q8_0 K = 576, 9 rows 80-81 -> 74-76, 16 rows
// 118-120 -> 100-104; Q4_K (qdot_lanes_k.h) K = 1024, 9 rows 114 -> 98-99, 16 rows 169 -> 149-151.
// The weights of the tile kLanesAhead tiles on are prefetched into L2, spread over the pairs of groups: one tile
// ahead into L1, as the row loops do, left one activation row at 0.69-0.72 ms against their 0.53-0.59 (a 49152 x
// 576 Q4_1 matrix from memory, 2 threads, AMD EPYC Zen 4): the 16 rows are read across, which the hardware's stream
// prefetch does not follow; three tiles ahead into L2 gave 0.49-0.59.
constexpr int kLanes = 16, kLaneRowsR = 8, kLanesAhead = 3;
constexpr int64_t kAmxRows = 9, kAmxMaxRows = 16;  // the AMX int8 path: from 9 activation rows, at most 16 a pass
static_assert(kLanes == kTileRows, "a tile of the tiled forms is one 16-lane tile");

// t[k] holds row k's eight dwords in its low 256 bits and row k + 8's in its high ones; on return t[i] holds dword i
// of rows 0-15, lane j row j's.
inline void transpose_dwords(__m512i t[8]) {
  __m512i u[8], v[8];
  for (int q = 0; q < 4; ++q) {
    u[2 * q] = _mm512_unpacklo_epi32(t[2 * q], t[2 * q + 1]);
    u[2 * q + 1] = _mm512_unpackhi_epi32(t[2 * q], t[2 * q + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 (8-11 and 12-15 above): dwords (0, 4), (1, 5), ...
    v[4 * h + 0] = _mm512_unpacklo_epi64(u[4 * h], u[4 * h + 2]);
    v[4 * h + 1] = _mm512_unpackhi_epi64(u[4 * h], u[4 * h + 2]);
    v[4 * h + 2] = _mm512_unpacklo_epi64(u[4 * h + 1], u[4 * h + 3]);
    v[4 * h + 3] = _mm512_unpackhi_epi64(u[4 * h + 1], u[4 * h + 3]);
  }
  // v[c] (c < 4): rows 0-3's dword c in 128-bit block 0, dword c + 4 in block 1, rows 8-11's in blocks 2, 3;
  // v[4 + c]: the same for rows 4-7 and 12-15.
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_permutex2var_epi64(v[c], lo, v[4 + c]);
    t[c + 4] = _mm512_permutex2var_epi64(v[c], hi, v[4 + c]);
  }
}

// Eight groups' f16 scales of 16 rows (row j's at p[j] + off) as float32 columns: col[g] lane j = row j's group g.
// Only the first n (even) are read; the columns past n are left as they are.
inline void transpose_halves(const uint8_t* const p[kLanes], int64_t off, int64_t n, float* col) {
  __m256i t[8], u[8], v[8];
  const __m128i mask = _mm256_castsi256_si128(lanes_below(n / 2));
  for (int k = 0; k < 8; ++k) {
    auto load = [&](const uint8_t* q) {
      return n == 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + off))
                    : _mm_maskload_epi32(reinterpret_cast<const int*>(q + off), mask);
    };
    t[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(load(p[k])), load(p[k + 8]), 1);
  }
  for (int q = 0; q < 4; ++q) {
    u[2 * q] = _mm256_unpacklo_epi16(t[2 * q], t[2 * q + 1]);
    u[2 * q + 1] = _mm256_unpackhi_epi16(t[2 * q], t[2 * q + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    v[4 * h + 0] = _mm256_unpacklo_epi32(u[4 * h], u[4 * h + 2]);
    v[4 * h + 1] = _mm256_unpackhi_epi32(u[4 * h], u[4 * h + 2]);
    v[4 * h + 2] = _mm256_unpacklo_epi32(u[4 * h + 1], u[4 * h + 3]);
    v[4 * h + 3] = _mm256_unpackhi_epi32(u[4 * h + 1], u[4 * h + 3]);
  }
  // v[c]: words 2c and 2c + 1 of rows 0-3 (of rows 8-11 in the high 128 bits), v[4 + c] those of rows 4-7 (12-15)
  for (int c = 0; c < 4; ++c) {
    const __m256i even = _mm256_unpacklo_epi64(v[c], v[4 + c]), odd = _mm256_unpackhi_epi64(v[c], v[4 + c]);
    if (2 * c < n) _mm512_storeu_ps(col + (2 * c) * kLanes, _mm512_cvtph_ps(even));
    if (2 * c + 1 < n) _mm512_storeu_ps(col + (2 * c + 1) * kLanes, _mm512_cvtph_ps(odd));
  }
}

// The tile's columns of scales (and minimums) for every group: sd[g * 16 + j], sm[g * 16 + j].
template <int T>
inline void tile_scales(const uint8_t* const p[kLanes], int64_t K, float* sd, float* sm) {
  const int64_t groups = K / kQK;
  for (int64_t g = 0; g < groups; g += 8) {
    const int64_t n = std::min<int64_t>(8, groups - g);
    transpose_halves(p, scales_at<T>(K) + 2 * g, n, sd + g * kLanes);
    if constexpr (T == kQ4_1R) transpose_halves(p, K / 2 + 2 * groups + 2 * g, n, sm + g * kLanes);
  }
  if constexpr (T == kQ4_0R || T == kQ8_0R) {  // d * (q - 8), d * (u - 128): a minimum of -8 d (-128 d)
    const __m512 eight = _mm512_set1_ps(offset_min<T>());
    for (int64_t g = 0; g < groups; ++g)
      _mm512_storeu_ps(sm + g * kLanes, _mm512_mul_ps(eight, _mm512_loadu_ps(sd + g * kLanes)));
  }
}

// The 16 rows' 32 bytes at offset `at` of each, transposed: t[i] dword i of rows 0-15 (lane k row k's).
inline void load_transposed16(const uint8_t* const p[kLanes], int64_t at, __m512i t[8]) {
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[k] + at))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[k + 8] + at)), 1);
  transpose_dwords(t);
}

// The integer dot products of a pair of decoded groups of 16 rows (w0[i] / w1[i]: values 4i .. 4i + 3 of each row's
// first / second group, unsigned bytes, one row a lane) with the pair's 64 activations at `a` (signed, the second
// group's from a + 32): s0 and s1, each group's in two chains. Every 16-lane loop that decodes to bytes comes here.
__attribute__((always_inline)) inline void pair_sums(const __m512i w0[8], const __m512i w1[8], const int8_t* a,
                                                     __m512i& s0, __m512i& s1) {
  auto four = [a](int i) {  // activations 4i .. 4i + 3 of the pair, in every lane
    int32_t v;
    std::memcpy(&v, a + 4 * i, 4);
    return _mm512_set1_epi32(v);
  };
  __m512i s0a = _mm512_setzero_si512(), s0b = s0a, s1a = s0a, s1b = s0a;  // two chains a group
  for (int i = 0; i < 8; i += 2) {
    s0a = _mm512_dpbusd_epi32(s0a, w0[i], four(i));
    s0b = _mm512_dpbusd_epi32(s0b, w0[i + 1], four(i + 1));
    s1a = _mm512_dpbusd_epi32(s1a, w1[i], four(8 + i));
    s1b = _mm512_dpbusd_epi32(s1b, w1[i + 1], four(9 + i));
  }
  s0 = _mm512_add_epi32(s0a, s0b);
  s1 = _mm512_add_epi32(s1a, s1b);
}

// A pair of groups' int32 sums s0, s1 (16 weight rows x one activation row, whose scales and block sums are da[0..1],
// sa[0..1]) into its accumulators: a0 / a1 the groups' scaled sums (two chains), macc the minimums times the block
// sums. The one place these float operations are written: the 16-lane loop and the AMX path both call it, in the
// same order group by group, so their results are the same bits.
__attribute__((always_inline)) inline void scaled_pair(__m512i s0, __m512i s1, __m512 d0, __m512 d1, __m512 m0v,
                                                       __m512 m1v, const float* da, const float* sa, __m512& a0,
                                                       __m512& a1, __m512& macc) {
  a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, _mm512_set1_ps(da[0])), a0);
  a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, _mm512_set1_ps(da[1])), a1);
  macc = _mm512_fmadd_ps(m1v, _mm512_set1_ps(sa[1]), _mm512_fmadd_ps(m0v, _mm512_set1_ps(sa[0]), macc));
}

// Activation rows m0 .. m0 + R - 1 times groups g and g + 1 of 16 weight rows, decoded: w0[i] (w1[i]) values 4i ..
// 4i + 3 of each row's group g (g + 1) as unsigned bytes, d0 / d1 the rows' scales, m0v / m1v their minimums. Into
// acc[r] (each group's scaled integer sums) and macc[r] (the minimums times the activation blocks' sums): the same
// operations for every format the 16-lane loops decode to bytes (packed and tiled Q4_0 / Q4_1 / Q8_0, Q5_0).
template <int R>
__attribute__((always_inline)) inline void pair_rows(const __m512i w0[8], const __m512i w1[8], __m512 d0, __m512 d1,
                                                     __m512 m0v, __m512 m1v, const QRows& x, int64_t m0, int64_t g,
                                                     __m512 acc[][2], __m512 macc[]) {
  const int64_t K = x.K, groups = K / kQK;
  for (int r = 0; r < R; ++r) {
    __m512i s0, s1;
    pair_sums(w0, w1, x.q + (m0 + r) * K + g * kQK, s0, s1);
    scaled_pair(s0, s1, d0, d1, m0v, m1v, x.d + (m0 + r) * groups + g, x.s + (m0 + r) * groups + g, acc[r][0],
                acc[r][1], macc[r]);
  }
}

// The weights of a later tile (`fetch`, `fetch_bytes`; kLanesAhead tiles on) prefetched into L2, spread over a tile's
// `pairs` pairs of groups: fetch_step's lines at pair g / 2 (prefetch_pair).
inline int64_t fetch_step(int64_t fetch_bytes, int64_t pairs) { return (fetch_bytes / pairs + 63) / 64 * 64; }

inline void prefetch_pair(const uint8_t* fetch, int64_t fetch_bytes, int64_t step, int64_t g) {
  for (int64_t o = (g / 2) * step; o < std::min(fetch_bytes, (g / 2 + 1) * step); o += 64)
    __builtin_prefetch(fetch + o, 0, 1);  // into L2 (prefetcht2)
}

// A pair of groups of 16 rows as bytes, in place: packed Q8_0 (w0, w1: each group's 32 bytes a row, transposed)
// flipped to q + 128; the 4-bit forms (w0: the pair's 32 bytes a row, g's values in the low nibbles, g + 1's in the
// high ones) split into w0 and w1.
template <int T>
__attribute__((always_inline)) inline void bytes_of_pair(__m512i w0[8], __m512i w1[8]) {
  if constexpr (T == kQ8_0R) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int i = 0; i < 8; ++i) {
      w0[i] = _mm512_xor_si512(w0[i], flip);
      w1[i] = _mm512_xor_si512(w1[i], flip);
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0xF);
    for (int i = 0; i < 8; ++i) {
      w1[i] = _mm512_and_si512(_mm512_srli_epi16(w0[i], 4), low);
      w0[i] = _mm512_and_si512(w0[i], low);
    }
  }
}

// Groups g and g + 1 of a tiled tile (quant.h: kQ4_0T ...; `tile` its first byte, rows of K values): their values
// as bytes (bytes_of_pair), their scales d0, d1 and minimums m0v, m1v (lane j row j's). The tile holds each 32-byte
// chunk of its 16 rows as the transpose leaves it, then the scale halves (K / 2 or K bytes a row on): 32 bytes a
// column.
template <int T>
__attribute__((always_inline)) inline void tiled_pair(const uint8_t* tile, int64_t K, int64_t g, __m512i w0[8],
                                                      __m512i w1[8], __m512& d0, __m512& d1, __m512& m0v,
                                                      __m512& m1v) {
  auto chunk = [tile](int64_t c, __m512i t[8]) {
    for (int k = 0; k < 8; ++k) t[k] = _mm512_loadu_si512(tile + 512 * c + 64 * k);
  };
  if constexpr (T == kQ8_0R) {
    chunk(g, w0);
    chunk(g + 1, w1);
  } else {
    chunk(g / 2, w0);
  }
  bytes_of_pair<T>(w0, w1);
  const int64_t groups = K / kQK;
  const uint8_t* halves = tile + kLanes * scales_at<T>(K);
  auto column = [halves](int64_t h) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + 32 * h)));
  };
  d0 = column(g), d1 = column(g + 1);
  if constexpr (T == kQ4_1R) {
    m0v = column(groups + g), m1v = column(groups + g + 1);
  } else {  // as tile_scales: a minimum of -8 d (-128 d)
    m0v = _mm512_mul_ps(_mm512_set1_ps(offset_min<T>()), d0);
    m1v = _mm512_mul_ps(_mm512_set1_ps(offset_min<T>()), d1);
  }
}

// res[r] (16 lanes) = activation row m0 + r times the tile's 16 rows, r < R. Rows: p[j] is row j, and sd / sm hold
// the tile's scale and minimum columns (tile_scales); Tiled (quant.h: kQ4_0T ...): p[0] is the tile, already
// transposed, its scales read from it (sd, sm unused): the same values in the same lanes, so the same bits.
template <int T, int R, bool Tiled = false>
inline void lanes_block(const uint8_t* const p[kLanes], const float* sd, const float* sm, const QRows& x, int64_t m0,
                        __m512* res, const uint8_t* fetch = nullptr, int64_t fetch_bytes = 0) {
  const int64_t K = x.K, groups = K / kQK;
  __m512 acc[R][2], macc[R];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = macc[r] = _mm512_setzero_ps();
  const int64_t step = fetch_step(fetch_bytes, groups / 2);
  for (int64_t g = 0; g < groups; g += 2) {
    prefetch_pair(fetch, fetch_bytes, step, g);
    __m512i w0[8], w1[8];  // groups g and g + 1: values 4i .. 4i + 3 of each row
    __m512 d0, d1, m0v, m1v;
    if constexpr (Tiled) {
      tiled_pair<T>(p[0], K, g, w0, w1, d0, d1, m0v, m1v);
    } else {
      if constexpr (T == kQ8_0R) {
        load_transposed16(p, kQK * g, w0);
        load_transposed16(p, kQK * (g + 1), w1);
      } else {
        load_transposed16(p, 16 * g, w0);
      }
      bytes_of_pair<T>(w0, w1);
      d0 = _mm512_loadu_ps(sd + g * kLanes), d1 = _mm512_loadu_ps(sd + (g + 1) * kLanes);
      m0v = _mm512_loadu_ps(sm + g * kLanes), m1v = _mm512_loadu_ps(sm + (g + 1) * kLanes);
    }
    pair_rows<R>(w0, w1, d0, d1, m0v, m1v, x, m0, g, acc, macc);
  }
  for (int r = 0; r < R; ++r) res[r] = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), macc[r]);
}

// The activation rows 0 .. M - 1 in blocks of at most kLaneRowsR that share a tile's decode, balanced (9 rows: 5 + 4,
// not 8 + 1): block(m, std::integral_constant<int, R>{}) for rows m .. m + R - 1. A row's result does not depend on
// its block (each row's operations are its own), so the split is free to follow the count.
template <int R = 1, typename F>
inline void row_block(int64_t rows, int64_t m, F& block) {
  if constexpr (R < kLaneRowsR)
    if (rows > R) return row_block<R + 1>(rows, m, block);
  block(m, std::integral_constant<int, R>{});
}

template <typename F>
inline void row_blocks(int64_t M, F&& block) {
  const int64_t blocks = (M + kLaneRowsR - 1) / kLaneRowsR;
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t rows = (M - m + blocks - b - 1) / (blocks - b);
    row_block(rows, m, block);
    m += rows;
  }
}

// The activation rows 0 .. M - 1 (at least kAmxRows) for the AMX path: passes of kAmxMaxRows (16) rows from the
// front, block(m, rows) with `rows` a number (the tile configuration follows it), the last pass taking what is left
// if that is kAmxRows or more; fewer left go through the 16-lane loop (row_blocks: block(m, integral_constant)),
// whose bits are the same. A pass costs about the same from 9 rows to 16 (`bench_qdot.py --amx`: K = 576, 35.5 ns
// a weight row at 9 rows, 49 at 16, against the 16-lane loop's 8.4 at one row and 34 at 8), so 17 rows as 16 + 1
// cost a pass and a row, where two balanced passes of 9 + 8 cost two passes: docs/speculative.md.
template <typename F>
inline void amx_chunks(int64_t M, F&& block) {
  int64_t m = 0;
  for (; M - m >= kAmxRows; m += std::min(kAmxMaxRows, M - m)) block(m, std::min(kAmxMaxRows, M - m));
  if (m < M) {
    auto rest = [&](int64_t r, auto rr) { block(m + r, rr); };
    row_blocks(M - m, rest);
  }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
// AMX int8 tiles for the tiled Q4_0 / Q4_1 / Q8_0 forms at kAmxRows activation rows and more (Sapphire Rapids and
// later; the avx512_bf16 build, used at the amx level: QScratch::amx). A pair of groups is decoded as the 16-lane loop
// decodes it (tiled_pair: lane j of register i holds row j's values 4i .. 4i + 3, which is an AMX B tile's row i),
// staged in memory as two B tiles, and `tdpbsud` multiplies each group with the rows' 32 activations read in place
// (A tiles, K bytes apart): each group's int32 sums, exact, as `vpdpbusd` gives them. Those go through scaled_pair's
// float operations in the same order, so the results are the 16-lane loop's bits for every number of rows (batch
// invariance holds across the two paths). Measured in a one-thread harness on this shape (K = 576, a tile in L2,
// docs/speculative.md "AMX int8 tiles for a verification's rows"): 0.81x the 16-lane loop at 5 rows, 1.14x at 8,
// 1.55x at 16 (staging the decoded bytes through memory is a fixed cost a pair); here, `bench_qdot.py --amx`
// (Q4_1, K = 576 and 1536, one thread, Intel Xeon with AMX): 0.97-0.98x at 8 rows, 1.11x at 9, 1.33x at 16: hence
// from 9 rows, and past 16 in passes of 16 with the rest under 9 on the 16-lane loop (amx_chunks).
constexpr bool kAmxInt8Build = true;

// This CPU has AMX-TILE and AMX-INT8 and Linux lets the process use the tiles (amx.cpp asks, once).
inline bool amx_int8_available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    __asm__ __volatile__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return (d >> 24 & 1) && (d >> 25 & 1) && peregrine::amx_tiles_permitted();  // AMX-TILE, AMX-INT8
  }();
  return ok;
}

// Tiles 0-1: a pair's two groups' int32 sums (`rows` activation rows x 16 weight rows), 2-3: the rows' 32
// activations of each group, 4-5: each group's 16 weight rows as bytes (8 rows of 64: four values a weight row).
inline void amx_int8_config(int64_t rows) {
  peregrine::TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = cfg.rows[3] = static_cast<uint8_t>(rows);
  cfg.colsb[0] = cfg.colsb[1] = 64;
  cfg.colsb[2] = cfg.colsb[3] = kQK;
  cfg.rows[4] = cfg.rows[5] = 8;
  cfg.colsb[4] = cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
}

inline void amx_int8_release() { _tile_release(); }

// res[r] (16 lanes) = activation row m0 + r times the tiled tile at `tile`, r < rows (<= kAmxMaxRows; the tile
// configuration holds `rows`): lanes_block<T, rows, true>'s bits. Each pass decodes the tile again: keeping a
// prompt's decoded tile for its later passes measured no faster (docs/speculative.md).
template <int T>
void amx_tile_rows(const uint8_t* tile, const QRows& x, int64_t m0, int64_t rows, __m512* res, const uint8_t* fetch,
                   int64_t fetch_bytes) {
  const int64_t K = x.K, groups = K / kQK, step = fetch_step(fetch_bytes, groups / 2);
  alignas(64) uint8_t b[2][512];
  alignas(64) int32_t c[2][kAmxMaxRows * kLanes];
  alignas(64) float acc[kAmxMaxRows][3][kLanes];  // each row's two groups' chains and its minimums
  for (int64_t r = 0; r < rows; ++r)
    for (int k = 0; k < 3; ++k) _mm512_store_ps(acc[r][k], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; g += 2) {
    prefetch_pair(fetch, fetch_bytes, step, g);
    __m512i w0[8], w1[8];
    __m512 d0, d1, m0v, m1v;
    tiled_pair<T>(tile, K, g, w0, w1, d0, d1, m0v, m1v);
    for (int i = 0; i < 8; ++i) {
      _mm512_store_si512(b[0] + 64 * i, w0[i]);
      _mm512_store_si512(b[1] + 64 * i, w1[i]);
    }
    const int8_t* a = x.q + m0 * K + g * kQK;
    _tile_loadd(4, b[0], 64);
    _tile_loadd(5, b[1], 64);
    _tile_loadd(2, a, K);
    _tile_loadd(3, a + kQK, K);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    for (int64_t r = 0; r < rows; ++r) {  // pair_rows' operations, in its order
      __m512 a0 = _mm512_load_ps(acc[r][0]), a1 = _mm512_load_ps(acc[r][1]), macc = _mm512_load_ps(acc[r][2]);
      scaled_pair(_mm512_load_si512(c[0] + kLanes * r), _mm512_load_si512(c[1] + kLanes * r), d0, d1, m0v, m1v,
                  x.d + (m0 + r) * groups + g, x.s + (m0 + r) * groups + g, a0, a1, macc);
      _mm512_store_ps(acc[r][0], a0), _mm512_store_ps(acc[r][1], a1), _mm512_store_ps(acc[r][2], macc);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    res[r] = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(acc[r][0]), _mm512_load_ps(acc[r][1])),
                           _mm512_load_ps(acc[r][2]));
}
#else
constexpr bool kAmxInt8Build = false;
inline bool amx_int8_available() { return false; }
inline void amx_int8_config(int64_t) {}
inline void amx_int8_release() {}
template <int T>
void amx_tile_rows(const uint8_t*, const QRows&, int64_t, int64_t, __m512*, const uint8_t*, int64_t) {}
#endif

// The first `count` lanes of v (those set in `mask`) to out (as O).
template <typename O>
inline void store_lanes(O* out, __m512 v, int64_t count, __mmask16 mask) {
  if constexpr (std::is_same_v<O, float>) {
    _mm512_mask_storeu_ps(out, mask, v);
  } else {
    alignas(64) float tmp[kLanes];
    _mm512_store_ps(tmp, v);
    for (int64_t j = 0; j < count; ++j) out[j] = static_cast<O>(tmp[j]);
  }
}

// Output rows [n_begin, n_end) of a tiled weight (quant.h: kQ4_0T ...; tiles of 16 rows from row 0): each tile that
// meets the range is multiplied whole (`block(p, m, rows, res, fetch, fetch_bytes)`: p[0] the tile, activation rows
// m .. m + rows - 1 into res, the first block prefetching the tile kLanesAhead on) and its lanes in the range stored.
template <bool Amx = false, typename O, typename F>
void tiles_in(const uint8_t* w, int64_t ldw, int64_t M, const float* bias, O* out, int64_t ldo, int64_t n_begin,
              int64_t n_end, F&& tile_block) {
  const int64_t end_row = (n_end + kLanes - 1) / kLanes * kLanes;  // the last tile met, whole
  prefetch_first(w, ldw, n_begin / kLanes * kLanes, end_row, kLanes * kLanesAhead);
  for (int64_t n = n_begin / kLanes * kLanes; n < n_end; n += kLanes) {
    const int64_t lo = std::max(n, n_begin), count = std::min(n + kLanes, n_end) - lo;
    const uint8_t* p[kLanes] = {w + n * ldw};
    const int64_t fetch_begin = std::min(end_row, n + kLanes * kLanesAhead) * ldw;
    const int64_t fetch_bytes = std::min(end_row, n + kLanes * (kLanesAhead + 1)) * ldw - fetch_begin;
    const __mmask16 mask = static_cast<__mmask16>(((1u << count) - 1) << (lo - n));
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    __m512 res[kAmxMaxRows];
    auto block = [&](int64_t m, auto rr) {
      tile_block(p, m, rr, res, m == 0 ? w + fetch_begin : nullptr, m == 0 ? fetch_bytes : 0);
      const int64_t RR = rr;  // (a constant on the 16-lane loops' path)
      for (int64_t r = 0; r < RR; ++r) {
        if (lo == n) {
          store_lanes(out + (m + r) * ldo + n, _mm512_add_ps(res[r], b), count, mask);
          continue;
        }
        alignas(64) float lanes[kLanes];  // a range that starts inside a tile (qlinear's split)
        _mm512_store_ps(lanes, _mm512_add_ps(res[r], b));
        for (int64_t j = 0; j < count; ++j) out[(m + r) * ldo + lo + j] = static_cast<O>(lanes[lo - n + j]);
      }
    };
    if constexpr (Amx)
      amx_chunks(M, block);
    else
      row_blocks(M, block);
  }
}

template <int T, typename O>
void qlinear_tiles(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                   int64_t n_begin, int64_t n_end, QScratch& s) {
  if (kAmxInt8Build && s.amx && M >= kAmxRows) {
    int64_t configured = 0;  // the rows the thread's tile configuration holds
    tiles_in<true>(w, ldw, M, bias, out, ldo, n_begin, n_end, [&](const uint8_t* const p[kLanes], int64_t m,
                                                                 auto rr, __m512* res, const uint8_t* fetch,
                                                                 int64_t fetch_bytes) {
      if constexpr (std::is_integral_v<decltype(rr)>) {  // an AMX pass (amx_chunks)
        if (rr != configured) amx_int8_config(configured = rr);
        amx_tile_rows<T>(p[0], x, m, rr, res, fetch, fetch_bytes);
      } else {  // the rows after the last pass
        lanes_block<T, decltype(rr)::value, true>(p, nullptr, nullptr, x, m, res, fetch, fetch_bytes);
      }
    });
    return;
  }
  tiles_in(w, ldw, M, bias, out, ldo, n_begin, n_end, [&](const uint8_t* const p[kLanes], int64_t m, auto rr,
                                                         __m512* res, const uint8_t* fetch, int64_t fetch_bytes) {
    lanes_block<T, decltype(rr)::value, true>(p, nullptr, nullptr, x, m, res, fetch, fetch_bytes);
  });
}

template <int T, typename O>
void qlinear_lanes(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                   int64_t n_begin, int64_t n_end, QScratch& s) {
  const int64_t K = x.K, groups = K / kQK;
  if (static_cast<int64_t>(s.sc.size()) < 2 * (groups + 8) * kLanes) s.sc.resize(2 * (groups + 8) * kLanes);
  float *sd = s.sc.data(), *sm = sd + (groups + 8) * kLanes;
  const int64_t ahead = kLanes * kLanesAhead;  // rows
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end; n += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n_end - n);
    const uint8_t* p[kLanes];
    for (int j = 0; j < kLanes; ++j) p[j] = w + (n + std::min<int64_t>(j, count - 1)) * ldw;
    const int64_t fetch_begin = std::min(n_end, n + ahead) * ldw;  // the tile `ahead` rows on
    const int64_t fetch_bytes = std::min(n_end, n + ahead + kLanes) * ldw - fetch_begin;
    tile_scales<T>(p, K, sd, sm);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    __m512 res[kLaneRowsR];
    auto block = [&](int64_t m, auto rr) {
      constexpr int RR = decltype(rr)::value;
      if (m == 0)
        lanes_block<T, RR>(p, sd, sm, x, m, res, w + fetch_begin, fetch_bytes);
      else
        lanes_block<T, RR>(p, sd, sm, x, m, res);
      for (int r = 0; r < RR; ++r) store_lanes(out + (m + r) * ldo + n, _mm512_add_ps(res[r], b), count, mask);
    };
    row_blocks(M, block);
  }
}
#else
constexpr bool lanes_packed(int) { return false; }
template <int T, typename O>  // never called here (lanes_packed): declared for qlinear_rows' discarded branch
void qlinear_lanes(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                   int64_t n_begin, int64_t n_end, QScratch& s);
template <int T, typename O>  // likewise
void qlinear_tiles(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                   int64_t n_begin, int64_t n_end, QScratch& s);
inline bool amx_int8_available() { return false; }
inline void amx_int8_release() {}
#endif

}  // namespace peregrine_quant
