// Q4_K rows (the file's blocks) in the AVX-512 VNNI builds, sixteen weight rows at a time, one a 32-bit lane, as
// qdot_lanes.h does for the packed 32-value formats: a super-block's 32-byte pairs of groups (low nibbles group 2j,
// high nibbles 2j + 1, as packed Q4_0 keeps them) are transposed in registers, and each `vpdpbusd` against one
// broadcast activation dword adds four products to each of the 16 rows. A group's integer sum is multiplied by its
// 6-bit scale in int32 (`vpmulld`), the super-block's sum converted once and scaled by d * dx, and its minimums
// (dmin * mn, float) taken off with the activation's 32-value sums (ksf): each row's own sequence of operations in
// its lane, so a row's result is the same bits in any tile, lane, thread split or batch. The tile's scales and
// minimums are unpacked once, in the lanes (tile_scales_k4), into scratch.
// The K-quant row loop (qdot_kquant.h) decodes a row's scales and weights for each (weight row, up to eight
// activation rows), and reduces 8 lanes a super-block and activation row; here one decode serves 16 weight rows and
// up to kLaneRowsR activation rows, and nothing is reduced across lanes.
#pragma once

#include "qdot_kquant.h"
#include "qdot_lanes.h"

namespace peregrine_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
constexpr bool lanes_k(int T) { return T == kQ4_K || T == kQ5_K; }

// The 512-bit operations of the width-generic helpers (qdot_lanes8.h's Ops256 at twice the width).
struct Ops512 {
  __m512i and_(__m512i a, __m512i b) const { return _mm512_and_si512(a, b); }
  __m512i or_(__m512i a, __m512i b) const { return _mm512_or_si512(a, b); }
  __m512i srli(__m512i a, int n) const { return _mm512_srli_epi16(a, n); }
  __m512i slli(__m512i a, int n) const { return _mm512_slli_epi16(a, n); }
  __m512i set1(int v) const { return _mm512_set1_epi8(static_cast<char>(v)); }
  __m512i srli32(__m512i a, int n) const { return _mm512_srli_epi32(a, n); }
  __m512i set1_32(int v) const { return _mm512_set1_epi32(v); }
};

// v[k] (16 bytes of row k) to v[c] (byte c of rows 0-15, lane k row k's).
inline void transpose_bytes16(__m128i v[16]) {
  __m128i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // t[i]: columns 0-7 of rows 2i, 2i + 1 as byte pairs; t[8 + i]: columns 8-15
    t[i] = _mm_unpacklo_epi8(v[2 * i], v[2 * i + 1]);
    t[8 + i] = _mm_unpackhi_epi8(v[2 * i], v[2 * i + 1]);
  }
  // u[8h + i]: columns 8h + 0-3 of rows 4i .. 4i + 3 (a dword a column); u[8h + 4 + i]: columns 8h + 4-7
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      u[8 * h + i] = _mm_unpacklo_epi16(t[8 * h + 2 * i], t[8 * h + 2 * i + 1]);
      u[8 * h + 4 + i] = _mm_unpackhi_epi16(t[8 * h + 2 * i], t[8 * h + 2 * i + 1]);
    }
  for (int q = 0; q < 4; ++q) {  // columns 4q .. 4q + 3: u[4q + i] holds them for rows 4i .. 4i + 3
    const __m128i a0 = _mm_unpacklo_epi32(u[4 * q], u[4 * q + 1]);      // cols 4q, 4q + 1 of rows 0-7
    const __m128i a1 = _mm_unpackhi_epi32(u[4 * q], u[4 * q + 1]);      // cols 4q + 2, 4q + 3 of rows 0-7
    const __m128i b0 = _mm_unpacklo_epi32(u[4 * q + 2], u[4 * q + 3]);  // the same of rows 8-15
    const __m128i b1 = _mm_unpackhi_epi32(u[4 * q + 2], u[4 * q + 3]);
    v[4 * q] = _mm_unpacklo_epi64(a0, b0);
    v[4 * q + 1] = _mm_unpackhi_epi64(a0, b0);
    v[4 * q + 2] = _mm_unpacklo_epi64(a1, b1);
    v[4 * q + 3] = _mm_unpackhi_epi64(a1, b1);
  }
}

// A tile's super-block b, in scratch: its eight 6-bit scales as int32 (16 a group: sc + 16 * (8b + j)), d and
// dmin * mn as float (fl + 16 * (9b + 0) for d, fl + 16 * (9b + 1 + j) for group j's minimum). Each row's first 16
// bytes (f16 d, f16 dmin, the 12 bytes of scales and minimums) become four vectors of one dword a row, and the
// scales and minimums are unpacked in the lanes, all 16 rows at once (ggml's get_scale_min_k4, as
// q4k_scales_mins_x): at one activation row, unpacking each row's by shuffles and transposing the bytes had been
// two fifths of a Q4_K matrix's time.
// (Tiled, quant.h kQ4_KT and kQ5_KT, the tile's super-blocks hold those four vectors as they are: lanes_block_k4
// reads them there and unpacks each value where it is used, q4k_scale and q4k_min.)
constexpr int64_t kLaneKFloats = 9 * kLanes, kLaneKInts = 8 * kLanes;
template <int T = kQ4_K>  // (Q5_K: the same first 16 bytes, in blocks of 176)
inline void tile_scales_k4(const uint8_t* const p[kLanes], int64_t nb, int32_t* sc, float* fl) {
  constexpr int64_t bytes = layout_of(T).bytes;
  // element k of the result: dword c of row k, rows 0-7 from the first two vectors' lanes, 8-15 from the others
  const __m512i pick[4] = {
      _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_setr_epi32(1, 5, 9, 13, 17, 21, 25, 29, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_setr_epi32(3, 7, 11, 15, 19, 23, 27, 31, 0, 0, 0, 0, 0, 0, 0, 0)};
  for (int64_t b = 0; b < nb; ++b) {
    __m512i dw[4];  // dw[c]: dword c of each row, row k in element k
    __m512i r[4];  // r[q]: rows 4q .. 4q + 3, a row's 16 bytes a 128-bit lane
    for (int q = 0; q < 4; ++q) {
      const uint8_t* const* rows = p + 4 * q;
      auto row = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + b * bytes)); };
      r[q] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(row(0)), row(1), 1),
                                                   row(2), 2), row(3), 3);
    }
    for (int c = 0; c < 4; ++c)
      dw[c] = _mm512_inserti64x4(_mm512_permutex2var_epi32(r[0], pick[c], r[1]),
                                 _mm512_castsi512_si256(_mm512_permutex2var_epi32(r[2], pick[c], r[3])), 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw[0]));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw[0], 16)));
    float* f = fl + b * kLaneKFloats;
    int32_t* s = sc + b * kLaneKInts;
    _mm512_storeu_ps(f, d);
    q4k_scales_mins_lanes(dw, Ops512{}, [&](int j, __m512i s_lo, __m512i s_hi, __m512i m_lo, __m512i m_hi) {
      _mm512_storeu_si512(s + kLanes * j, s_lo);
      _mm512_storeu_si512(s + kLanes * (4 + j), s_hi);
      _mm512_storeu_ps(f + kLanes * (1 + j), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m_lo)));
      _mm512_storeu_ps(f + kLanes * (5 + j), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m_hi)));
    });
  }
}

// A pair's 32 bytes of nibbles a row, transposed (t[i]: bytes 4i .. 4i + 3 of each row), as the low nibbles' values
// (w0, a byte each) and the high ones' kept in place, 16 times their value (w1: `vpdpbusd` takes them as unsigned
// bytes up to 240, and lanes_block_k4 shifts their sums back by 4, exactly: every product is a multiple of 16), an
// `and` each instead of a shift and an `and` for the high ones. `bench_qdot.py --format Q4_K --against` (AMD EPYC
// Zen 4, one thread, rows in L2, the speed ratio's median and quartiles over 40 alternating batches): 1.10x
// (1.03-1.29) and 1.08x (0.91-1.17) at K 1024 and 3072 at one activation row, 0.98x and 1.05x at four.
__attribute__((always_inline)) inline void high_nibbles(const __m512i t[8], __m512i w0[8], __m512i w1[8]) {
  const __m512i low = _mm512_set1_epi8(0xF), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int i = 0; i < 8; ++i) {
    w0[i] = _mm512_and_si512(t[i], low);
    w1[i] = _mm512_and_si512(t[i], high);
  }
}

// res[r] (16 lanes) = activation row m0 + r times the tile's 16 Q4_K rows, r < R (Tiled: p[0] is the tile, its
// nibbles read as they lie: the same values in the same lanes, so the same bits). Q5_K (T): the same, its nibbles
// after the 32 bytes of fifth bits (qh), which are transposed as the nibbles are (tiled: read as they lie), once a
// super-block; group g's value l takes bit g of qh[l] as 16 (a bit test and a masked add a register of four values a
// row).
template <int R, bool Tiled = false, int T = kQ4_K>
inline void lanes_block_k4(const uint8_t* const p[kLanes], const int32_t* sc, const float* fl, const QRows& x,
                           int64_t m0, __m512* res, const uint8_t* fetch = nullptr, int64_t fetch_bytes = 0) {
  constexpr int64_t bytes = layout_of(T).bytes, qs = T == kQ5_K ? 48 : 16;  // where the nibbles start
  const int64_t K = x.K, nb = K / kQK_K;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0xF);
  const int64_t pairs = 4 * nb, step = (fetch_bytes / pairs + 63) / 64 * 64;  // the lines to fetch a pair
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R], qh[8], dw[4];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    // Tiled: d, dmin and the scales and minimums unpacked where each is used (q4k_scale, q4k_min), from the tile's
    // first four dwords a row as they lie, not a tile's worth through scratch first (tile_scales_k4, the untiled
    // loop's). Unpacked once a tile in scratch, they had been about 30% of the tiled Q4_K loop's time at one
    // activation row (that pass skipped, wrongly, ran 1.40x faster). This and high_nibbles together against the loop
    // before both (`bench_qdot.py --against`, AMD EPYC Zen 4, one thread, rows in L2, K 1024 / 3072): Q4_K 1.05x
    // (0.93-1.19) / 1.23x (1.16-1.35) at one row, 1.02x / 1.02x at four; Q5_K 1.21x (1.06-1.33) / 1.37x (1.30-1.43)
    // at one row, 1.11x / 1.04x at four.
    if constexpr (Tiled)
      for (int c = 0; c < 4; ++c) dw[c] = _mm512_loadu_si512(p[0] + kLanes * bytes * b + 64 * c);
    if constexpr (T == kQ5_K && Tiled) {  // dwords 4 .. 11 of the super-block
      for (int i = 0; i < 8; ++i) qh[i] = _mm512_loadu_si512(p[0] + kLanes * bytes * b + 64 * (4 + i));
    } else if constexpr (T == kQ5_K) {
      load_transposed16(p, b * bytes + 16, qh);
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t pair = 4 * b + j;
      for (int64_t o = pair * step; o < std::min(fetch_bytes, (pair + 1) * step); o += 64)
        __builtin_prefetch(fetch + o, 0, 1);  // into L2 (prefetcht2)
      __m512i t[8];
      if constexpr (Tiled) {  // dwords qs / 4 + 8j .. qs / 4 + 8j + 7 of the super-block
        for (int k = 0; k < 8; ++k)
          t[k] = _mm512_loadu_si512(p[0] + kLanes * bytes * b + 64 * (qs / 4 + 8 * j + k));
      } else {
        load_transposed16(p, b * bytes + qs + 32 * j, t);  // the pair's 32 bytes of nibbles
      }
      __m512i w0[8], w1[8];  // groups 2j and 2j + 1: values 4i .. 4i + 3 of each row (Q4_K: 2j + 1's times 16)
      if constexpr (T == kQ4_K) {
        high_nibbles(t, w0, w1);
      } else {
        for (int i = 0; i < 8; ++i) {
          w0[i] = _mm512_and_si512(t[i], low);
          w1[i] = _mm512_and_si512(_mm512_srli_epi16(t[i], 4), low);
        }
      }
      if constexpr (T == kQ5_K) {  // the fifth bits: bit 2j of qh[l] for group 2j's value l, 2j + 1 for the other
        const __m512i sixteen = _mm512_set1_epi8(16), bit0 = _mm512_set1_epi8(static_cast<char>(1 << (2 * j))),
                      bit1 = _mm512_set1_epi8(static_cast<char>(2 << (2 * j)));
        for (int i = 0; i < 8; ++i) {
          w0[i] = _mm512_mask_add_epi8(w0[i], _mm512_test_epi8_mask(qh[i], bit0), w0[i], sixteen);
          w1[i] = _mm512_mask_add_epi8(w1[i], _mm512_test_epi8_mask(qh[i], bit1), w1[i], sixteen);
        }
      }
      const int32_t* scales = sc + b * kLaneKInts + kLanes * 2 * j;  // (untiled: tile_scales_k4's)
      const __m512i s0 = Tiled ? q4k_scale(dw, 2 * j, Ops512{}) : _mm512_loadu_si512(scales),
                    s1 = Tiled ? q4k_scale(dw, 2 * j + 1, Ops512{}) : _mm512_loadu_si512(scales + kLanes);
      for (int r = 0; r < R; ++r) {
        __m512i p0, p1;
        pair_sums(w0, w1, x.kq + (m0 + r) * K + b * kQK_K + 64 * j, p0, p1);
        if constexpr (T == kQ4_K) p1 = _mm512_srai_epi32(p1, 4);  // (high_nibbles: exact)
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(p0, s0), _mm512_mullo_epi32(p1, s1)));
      }
    }
    __m512 d, mins[8];  // d, and each group's dmin * minimum (tile_scales_k4's, the same values)
    if constexpr (Tiled) {
      d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw[0]));
      const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw[0], 16)));
      for (int j = 0; j < 8; ++j) mins[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(q4k_min(dw, j, Ops512{})));
    } else {
      const float* f = fl + b * kLaneKFloats;
      d = _mm512_loadu_ps(f);
      for (int j = 0; j < 8; ++j) mins[j] = _mm512_loadu_ps(f + kLanes * (1 + j));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x.kd[row * nb + b])),
                                 acc[r]);
      const float* ksf = x.ksf + row * (K / kQK) + 8 * b;
      for (int j = 0; j < 8; ++j) v = _mm512_fnmadd_ps(mins[j], _mm512_set1_ps(ksf[j]), v);
      acc[r] = v;
    }
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r];
}

template <int T, typename O>
void qlinear_lanes_k(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                     int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  static_assert(lanes_k(T), "lanes_k");
  const int64_t nb = x.K / kQK_K;
  const int64_t floats = nb * (kLaneKFloats + kLaneKInts);
  if (static_cast<int64_t>(s.sc.size()) < floats) s.sc.resize(floats);
  float* fl = s.sc.data();
  int32_t* sc = reinterpret_cast<int32_t*>(fl + nb * kLaneKFloats);
  const int64_t ahead = kLanes * kLanesAhead;  // rows
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end; n += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n_end - n);
    const uint8_t* p[kLanes];
    for (int j = 0; j < kLanes; ++j) p[j] = w + (n + std::min<int64_t>(j, count - 1)) * ldw;
    const int64_t fetch_begin = std::min(n_end, n + ahead) * ldw;  // the tile `ahead` rows on
    const int64_t fetch_bytes = std::min(n_end, n + ahead + kLanes) * ldw - fetch_begin;
    tile_scales_k4<T>(p, nb, sc, fl);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    __m512 res[kLaneRowsR];
    auto block = [&](int64_t m, auto rr) {
      constexpr int RR = decltype(rr)::value;
      if (m == 0)
        lanes_block_k4<RR, false, T>(p, sc, fl, x, m, res, w + fetch_begin, fetch_bytes);
      else
        lanes_block_k4<RR, false, T>(p, sc, fl, x, m, res);
      for (int r = 0; r < RR; ++r) store_lanes(out + (m + r) * ldo + n, _mm512_add_ps(res[r], bv), count, mask);
    };
    row_blocks(M, block);
  }
}

// qlinear_tiles (qdot_lanes.h) for tiled Q4_K or Q5_K (T; quant.h: kQ4_KT, kQ5_KT): each tile that meets
// [n_begin, n_end) multiplied whole, its lanes in the range stored.
template <int T, typename O>
void qlinear_tiles_k(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                     int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  (void)s;  // (the tiles' scales are unpacked in the loop: no scratch)
  tiles_in(w, ldw, M, bias, out, ldo, n_begin, n_end, [&](const uint8_t* const p[kLanes], int64_t m, auto rr,
                                                         __m512* res, const uint8_t* fetch, int64_t fetch_bytes) {
    lanes_block_k4<decltype(rr)::value, true, T>(p, nullptr, nullptr, x, m, res, fetch, fetch_bytes);
  });
}
#else
constexpr bool lanes_k(int) { return false; }
template <int T, typename O>  // never called here (lanes_k): declared for qlinear_rows' discarded branch
void qlinear_lanes_k(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                     int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);
template <int T, typename O>  // likewise
void qlinear_tiles_k(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                     int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);
#endif

}  // namespace peregrine_quant
