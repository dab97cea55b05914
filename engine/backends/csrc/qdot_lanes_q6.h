// Q6_K rows (the file's blocks) in the AVX-512 VNNI builds, sixteen weight rows at a time, one a 32-bit lane: the
// design of qdot_lanes8.h's Q6_K lanes at twice the width, with `vpdpbusd`. A tile's super-block is decoded once into
// scratch (the 16 rows' ql and qh bytes transposed in registers, 16 x 8 dwords, the six bits put together: 4 KiB,
// with the 16 int8 scales of each row as int32 lanes and d), then every activation row of the block meets it: four
// `vpdpbusd` against broadcast activation dwords give a 16-value group's sum for the 16 rows, started at
// -32 sum(a_s) (Q6_K's offset of 32), times the group's scale in int32 (`vpmulld`). Q4_K_M files keep attn_v, half
// the ffn_down matrices and often the output matrix in Q6_K: a third of Phi-3.5-mini's bytes.
//
// Each lane is its row's own sequence: the super-block's exact int32 sum sum_s sc_s (q_s . a_s - 32 sum(a_s)) (the
// integers of the row loop and of qdot_lanes8.h's lanes, however they are grouped), then fma(sum, d * dx, acc)
// super-block by super-block: qdot_lanes8.h's float operations and those of the row loop (qdot_kquant.h's dot_q6k),
// so a row's result is the same bits in the AVX2 build, here, in any tile, thread split or batch.
#pragma once

#include "qdot_lanes8.h"
#include "qdot_lanes_k.h"

namespace peregrine_quant {

// Activation rows from which Q6_K goes through the lanes (here and qdot_lanes8.h's); fewer take qdot_kquant.h's row
// loop, the same bits. scripts/bench_qdot.py --format Q6_K, one thread, rows in L2, AMD EPYC Zen 4, ns a weight row
// at K = 3072 (8192), the lanes against the row loop they replaced: avx2 build, 4 rows 239-273 (700-730) against
// 236-267 (700-712), 16 rows 635-654 (1947-2059) against 924-1156 (2557-3054); avx512_bf16 build, 4 rows 182-185
// (535-540) against 199-209 (577-588), 16 rows 458-462 (1410-1447) against 740-781 (2139-2242). At one row the
// lanes were 1.2-1.5x slower than the row loop (transposes shared by nothing).
constexpr int64_t kLanesQ6Rows = 4;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
constexpr bool lanes_q6(int T) { return T == kQ6_K; }

struct Lanes16BlockQ6 {
  __m512i wd[64];  // wd[4s + i]: values 16s + 4i .. + 3 of each lane's row, 0-63
  __m512i sc[16];  // group s's int8 scale of each lane, as int32
  __m512 d;
};

inline void decode_block16(const uint8_t* const p[kLanes], int64_t at, Lanes16BlockQ6& blk) {
  for (int n = 0; n < 2; ++n) {
    __m512i l0[8], l1[8], h[8];
    load_transposed16(p, at + 64 * n, l0);
    load_transposed16(p, at + 64 * n + 32, l1);
    load_transposed16(p, at + 128 + 32 * n, h);
    q6k_half(l0, l1, h, Ops512{},
             [&](int g, int i, __m512i v) { _mm512_store_si512(&blk.wd[8 * (4 * n + g) + i], v); });
  }
  __m128i v[16];
  alignas(32) uint16_t dh[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[k] + at + 192));
    std::memcpy(&dh[k], p[k] + at + 208, 2);
  }
  transpose_bytes16(v);
  for (int s = 0; s < 16; ++s) _mm512_store_si512(&blk.sc[s], _mm512_cvtepi8_epi32(v[s]));
  blk.d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
}

// Group s's int8 scale in each of the 16 lanes of a tiled Q6_K super-block (kQ6_KT), sign-extended from byte s % 4 of
// the scale dwords scw[s / 4] (dwords 48-51 of the tile).
__attribute__((always_inline)) inline __m512i tile_scale_q6(const __m512i scw[4], int s) {
  return _mm512_srai_epi32(_mm512_slli_epi32(scw[s / 4], 24 - 8 * (s % 4)), 24);
}

// decode_block16 for a tiled super-block (quant.h: kQ6_KT; t its 3,360 bytes): the same registers, loaded as they
// lie; the int8 scales taken from their four dwords by shifts.
inline void decode_tile16(const uint8_t* t, Lanes16BlockQ6& blk) {
  auto dword = [t](int i) { return _mm512_loadu_si512(t + 64 * i); };  // dword i of each row
  for (int n = 0; n < 2; ++n) {
    __m512i l0[8], l1[8], h[8];
    for (int i = 0; i < 8; ++i) {
      l0[i] = dword(16 * n + i);
      l1[i] = dword(16 * n + 8 + i);
      h[i] = dword(32 + 8 * n + i);
    }
    q6k_half(l0, l1, h, Ops512{},
             [&](int g, int i, __m512i v) { _mm512_store_si512(&blk.wd[8 * (4 * n + g) + i], v); });
  }
  const __m512i scw[4] = {dword(48), dword(49), dword(50), dword(51)};
  for (int s = 0; s < 16; ++s) blk.sc[s] = tile_scale_q6(scw, s);
  blk.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * 52)));
}

// acc[r] (16 lanes, accs + 16 r) = fma(isum[r], d * dx, acc[r]): super-block b's exact integer sums of activation
// rows m + r, r < R, added as the row loops add them (dx: the activation block's scale).
template <int R>
__attribute__((always_inline)) inline void lanes16_add(const __m512i* isum, __m512 d, const QRows& x, int64_t m,
                                                       int64_t b, float* accs) {
  const int64_t nb = x.K / kQK_K;
  for (int r = 0; r < R; ++r) {
    float* acc = accs + r * kLanes;
    _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                                          _mm512_mul_ps(d, _mm512_set1_ps(x.kd[(m + r) * nb + b])),
                                          _mm512_loadu_ps(acc)));
  }
}

// Activation rows m .. m + R - 1 at super-block b, as the 16-lane K-quant loops read them: their int8 values (a),
// their 16-value sums (ks), and an int32 sum vector each (isum), zeroed.
template <int R>
__attribute__((always_inline)) inline void rows_at(const QRows& x, int64_t m, int64_t b, const int8_t* a[R],
                                                   const int16_t* ks[R], __m512i isum[R]) {
  for (int r = 0; r < R; ++r) {
    a[r] = x.kq + (m + r) * x.K + b * kQK_K;
    ks[r] = x.ks + (m + r) * (x.K / 16) + 16 * b;
    isum[r] = _mm512_setzero_si512();
  }
}

// Four int8 values (a dword) in every lane.
inline __m512i broadcast4(const int8_t* v) {
  int32_t u;
  std::memcpy(&u, v, 4);
  return _mm512_set1_epi32(u);
}

// acc[r] (16 lanes) += activation row m + r's super-block b times the tile's decoded super-block, r < R.
template <int R>
__attribute__((always_inline)) inline void lanes16_rows_q6(const Lanes16BlockQ6& blk, const QRows& x, int64_t m,
                                                           int64_t b, float* accs) {
  const int8_t* a[R];
  const int16_t* ks[R];
  __m512i isum[R];
  rows_at<R>(x, m, b, a, ks, isum);
  for (int s = 0; s < 16; ++s) {
    const __m512i w0 = _mm512_load_si512(&blk.wd[4 * s]), w1 = _mm512_load_si512(&blk.wd[4 * s + 1]),
                  w2 = _mm512_load_si512(&blk.wd[4 * s + 2]), w3 = _mm512_load_si512(&blk.wd[4 * s + 3]);
    const __m512i sc = _mm512_load_si512(&blk.sc[s]);
    for (int r = 0; r < R; ++r) {
      const int8_t* v = a[r] + 16 * s;
      __m512i p = _mm512_set1_epi32(-32 * static_cast<int32_t>(ks[r][s]));
      p = _mm512_dpbusd_epi32(p, w0, broadcast4(v));
      p = _mm512_dpbusd_epi32(p, w1, broadcast4(v + 4));
      p = _mm512_dpbusd_epi32(p, w2, broadcast4(v + 8));
      p = _mm512_dpbusd_epi32(p, w3, broadcast4(v + 12));
      isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p, sc));
    }
  }
  lanes16_add<R>(isum, blk.d, x, m, b, accs);
}

// lanes16_rows_q6 for a tiled super-block (t its 3,360 bytes) met by fewer than kLanesQ6Rows activation rows: its
// values decoded in registers and multiplied at once (nothing through scratch). The same exact integer sums (in
// another order), the same float operations.
template <int G, int R>
__attribute__((always_inline)) inline void tile_group_q6(const uint8_t* t, int n, const int8_t* const a[R],
                                                         const int16_t* const ks[R], const __m512i scw[4],
                                                         __m512i isum[R]) {
  auto dword = [t](int i) { return _mm512_loadu_si512(t + 64 * i); };
  for (int half = 0; half < 2; ++half) {
    const int s = 8 * n + 2 * G + half;  // the 16 values' group (its scale and activations)
    __m512i v[4];
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * half + k;
      v[k] = q6k_values<G>(dword(16 * n + i), dword(16 * n + 8 + i), dword(32 + 8 * n + i), Ops512{});
    }
    const __m512i sc = tile_scale_q6(scw, s);
    for (int r = 0; r < R; ++r) {
      __m512i p = _mm512_set1_epi32(-32 * static_cast<int32_t>(ks[r][s]));
      for (int k = 0; k < 4; ++k) p = _mm512_dpbusd_epi32(p, v[k], broadcast4(a[r] + 16 * s + 4 * k));
      isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p, sc));
    }
  }
}

template <int R>
__attribute__((always_inline)) inline void tile_rows_q6(const uint8_t* t, const QRows& x, int64_t m, int64_t b,
                                                        float* accs) {
  const int8_t* a[R];
  const int16_t* ks[R];
  __m512i isum[R];
  rows_at<R>(x, m, b, a, ks, isum);
  __m512i scw[4];
  for (int c = 0; c < 4; ++c) scw[c] = _mm512_loadu_si512(t + 64 * (48 + c));
  for (int n = 0; n < 2; ++n) {
    tile_group_q6<0, R>(t, n, a, ks, scw, isum);
    tile_group_q6<1, R>(t, n, a, ks, scw, isum);
    tile_group_q6<2, R>(t, n, a, ks, scw, isum);
    tile_group_q6<3, R>(t, n, a, ks, scw, isum);
  }
  lanes16_add<R>(isum, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * 52))), x, m, b,
                 accs);
}

// out[m * ldo + n] = x[m] . W[n] (+ bias[n]) for n in [n_begin, n_end), m < M, W of format T in super-blocks that
// `decode(p, at, blk)` turns into a Block for 16 weight rows and `rows(blk, m, b, acc, R)` multiplies with R
// activation rows: lanes_tiles' loop, 16 weight rows a tile, the tile kLanesAhead on prefetched into L2.
template <int T, typename Block, typename O, typename Decode, typename Rows>
void qlinear_lanes16(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                     int64_t n_begin, int64_t n_end, QScratch& s, Decode&& decode, Rows&& rows) {
  const int64_t mt = std::max<int64_t>(16, (64 << 10) / x.K);
  lanes_tiles<kLanes, Block>(
      w, ldw, layout_of(T).bytes, x, M, n_begin, n_end, mt, kLanes * kLanesAhead, s, decode, rows,
      [&](int64_t n, int64_t count, int64_t m0, int64_t m1, const float* accs) {
        const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
        for (int64_t m = m0; m < m1; ++m)
          store_lanes(out + m * ldo + n, _mm512_add_ps(_mm512_loadu_ps(accs + (m - m0) * kLanes), bv), count, mask);
      });
}

template <int T, typename O>
void qlinear_lanes_q6(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  static_assert(T == kQ6_K, "lanes_q6");
  qlinear_lanes16<T, Lanes16BlockQ6>(
      w, ldw, x, M, bias, out, ldo, n_begin, n_end, s,
      [](const uint8_t* const* p, int64_t at, Lanes16BlockQ6& blk) { decode_block16(p, at, blk); },
      [&](const Lanes16BlockQ6& blk, int64_t m, int64_t b, float* acc, auto r) {
        lanes16_rows_q6<decltype(r)::value>(blk, x, m, b, acc);
      });
}

// qlinear_lanes_q6 for tiled Q6_K (quant.h: kQ6_KT), every number of activation rows: the same loop over the whole
// tiles that meet [n_begin, n_end) (a thread's share may start or end inside one), each super-block decoded from the
// tile as it lies (no transposes: at one activation row they had cost more than the row loop's whole work), the
// lanes in the range stored. The same integers and float operations, so the same bits as the rows.
template <typename O>
void qlinear_tiles_q6(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  const int64_t lo = n_begin / kLanes * kLanes, hi = (n_end + kLanes - 1) / kLanes * kLanes;
  const int64_t mt = std::max<int64_t>(16, (64 << 10) / x.K);
  auto store = [&](int64_t n, int64_t, int64_t m0, int64_t m1, const float* accs) {
    const int64_t j0 = std::max(n, n_begin) - n, j1 = std::min(n + kLanes, n_end) - n;
    const __mmask16 mask = static_cast<__mmask16>(((1u << (j1 - j0)) - 1) << j0);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t m = m0; m < m1; ++m) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(accs + (m - m0) * kLanes), bv);
      if (j0 == 0) {
        store_lanes(out + m * ldo + n, v, j1, mask);
        continue;
      }
      alignas(64) float lanes[kLanes];
      _mm512_store_ps(lanes, v);
      for (int64_t j = j0; j < j1; ++j) out[m * ldo + n + j] = static_cast<O>(lanes[j]);
    }
  };
  if (M < kLanesQ6Rows) {  // each super-block multiplied as it is decoded (the "block" is where it lies)
    struct At {
      const uint8_t* t;
    };
    lanes_tiles<kLanes, At>(
        w, ldw, layout_of(kQ6_K).bytes, x, M, lo, hi, mt, kLanes * kLanesAhead, s,
        [](const uint8_t* const* p, int64_t at, At& blk) { blk.t = p[0] + kLanes * at; },
        [&](const At& blk, int64_t m, int64_t b, float* acc, auto r) {
          tile_rows_q6<decltype(r)::value>(blk.t, x, m, b, acc);
        },
        store);
    return;
  }
  lanes_tiles<kLanes, Lanes16BlockQ6>(
      w, ldw, layout_of(kQ6_K).bytes, x, M, lo, hi, mt, kLanes * kLanesAhead, s,
      [](const uint8_t* const* p, int64_t at, Lanes16BlockQ6& blk) { decode_tile16(p[0] + kLanes * at, blk); },
      [&](const Lanes16BlockQ6& blk, int64_t m, int64_t b, float* acc, auto r) {
        lanes16_rows_q6<decltype(r)::value>(blk, x, m, b, acc);
      },
      store);
}
#else
constexpr bool lanes_q6(int) { return false; }
template <int T, typename O>  // never called here (lanes_q6): declared for qlinear_rows' discarded branch
void qlinear_lanes_q6(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);
template <typename O>  // likewise
void qlinear_tiles_q6(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);
#endif

}  // namespace peregrine_quant
