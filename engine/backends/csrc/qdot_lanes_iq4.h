// IQ4_XS rows (the file's blocks) in the AVX-512 VNNI builds, sixteen weight rows at a time, one a 32-bit lane: the
// design of qdot_lanes_q6.h's Q6_K lanes. A tile's super-block is decoded once into scratch: the 16 rows' nibbles
// transposed in registers (16 x 8 dwords a pair of groups) and looked up in IQ4's table by one `vpshufb` each, the
// table's values offset by 128 (1-241) so that `vpdpbusd` takes them unsigned, with the 8 signed 6-bit scales of each
// row as int32 lanes and d (4.6 KiB). Every activation row of the block then meets it: eight `vpdpbusd` against
// broadcast activation dwords give a 32-value group's sum for the 16 rows, started at -128 sum(a_j) (the offset taken
// back with the activations' 16-value sums), times the group's scale in int32 (`vpmulld`). Before these lanes a
// prefill step's IQ4_XS matmuls went four activation rows at a time through the row loop's AVX2 body (the sign
// trick a group at a time), and an IQ4_XS file's first token took 1.58x llama-server's time (docs/benchmarks.md).
//
// Each lane is its row's own sequence: the super-block's exact int32 sum sum_j ls_j (w_j . a_j) (the integers of the
// row loop, however they are grouped), then fma(sum, d * dx, acc) super-block by super-block, so a row's result is
// the same bits in any tile, thread split or batch. Not the row loop's bits (qdot_kquant.h's dot_iq4xs converts
// each of its eight int32 lanes and sums them in float): these lanes serve every number of activation rows in these
// builds, so that loop is not used here. Giving the row loop these float operations (each super-block's lanes
// reduced to one integer first) made it 7-14% slower at one row in the AVX2 build. On AVX2 without VNNI
// `vpmaddubsw` would saturate on the offset values (241 x 127 x 2), so those builds keep the row loop.
//
// Unlike Q6_K's, these lanes serve every number of activation rows, one included: the row loop's sign trick costs
// more than the transposes. scripts/bench_qdot.py --format IQ4_XS, one thread, rows in L2, AMD EPYC Zen 4
// (avx512_bf16 build), ns a weight row at K = 1024 (3072), the row loop against the lanes: 1 row 44.7-46.1
// (129-175) against 31.3 (90.7), 2 rows 55.3-74.3 (160-192) against 39.0-39.4 (118), 4 rows 81.2 (250) against
// 46.1-48.0 (140-144), 8 rows 160 (456) against 69.9-71.3 (215-220), 16 rows 362 (937) against 118-127 (367-377).
#pragma once

#include "qdot_lanes_q6.h"

namespace peregrine_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
constexpr bool lanes_iq4(int T) { return T == kIQ4_XS; }

struct Lanes16BlockIQ4 {
  __m512i wd[64];  // wd[8j + i]: values 32j + 4i .. + 3 of each lane's row, kIQ4[q] + 128
  __m512i sc[8];   // group j's scale (ls_j - 32) of each lane, as int32
  __m512 d;
};

inline void decode_block16_iq4(const uint8_t* const p[kLanes], int64_t at, Lanes16BlockIQ4& blk) {
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_xor_si128(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4)), _mm_set1_epi8(static_cast<char>(0x80))));
  const __m512i low = _mm512_set1_epi8(0xF);
  for (int pair = 0; pair < 4; ++pair) {  // groups 2 pair and 2 pair + 1, 16 bytes each a row
    __m512i t[8];  // t[i]: dword i of the pair's 32 bytes; a byte's low nibble is value l, its high one l + 16
    load_transposed16(p, at + 8 + 32 * pair, t);
    for (int i = 0; i < 8; ++i) {
      const int j = 2 * pair + i / 4, k = i % 4;
      _mm512_store_si512(&blk.wd[8 * j + k], _mm512_shuffle_epi8(table, _mm512_and_si512(t[i], low)));
      _mm512_store_si512(&blk.wd[8 * j + 4 + k],
                         _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(t[i], 4), low)));
    }
  }
  // each row's first 8 bytes (f16 d, scales_h, scales_l) a qword, split into dwords: d | scales_h << 16, scales_l
  alignas(64) uint64_t head[kLanes];
  for (int k = 0; k < kLanes; ++k) std::memcpy(&head[k], p[k] + at, 8);
  const __m512i h0 = _mm512_load_si512(head), h1 = _mm512_load_si512(head + 8);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i dh = _mm512_permutex2var_epi32(h0, even, h1),
                sl = _mm512_permutex2var_epi32(h0, _mm512_add_epi32(even, _mm512_set1_epi32(1)), h1);
  blk.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh));
  for (int j = 0; j < 8; ++j) {  // iq4xs_scale: low 4 bits from scales_l's nibble j, high 2 from scales_h's bits 2j
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * j), _mm512_set1_epi32(0xF));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(dh, 16 + 2 * j), _mm512_set1_epi32(3));
    _mm512_store_si512(&blk.sc[j],
                       _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32)));
  }
}

// acc[r] (16 lanes) += activation row m + r's super-block b times the tile's decoded super-block, r < R.
template <int R>
__attribute__((always_inline)) inline void lanes16_rows_iq4(const Lanes16BlockIQ4& blk, const QRows& x, int64_t m,
                                                            int64_t b, float* accs) {
  const int8_t* a[R];
  const int16_t* ks[R];
  __m512i isum[R];
  rows_at<R>(x, m, b, a, ks, isum);
  for (int j = 0; j < 8; ++j) {
    __m512i w[8];
    for (int i = 0; i < 8; ++i) w[i] = _mm512_load_si512(&blk.wd[8 * j + i]);
    const __m512i sc = _mm512_load_si512(&blk.sc[j]);
    for (int r = 0; r < R; ++r) {
      const int8_t* v = a[r] + 32 * j;
      __m512i p = _mm512_set1_epi32(-128 * (static_cast<int32_t>(ks[r][2 * j]) + ks[r][2 * j + 1]));
      __m512i q = _mm512_setzero_si512();  // (two chains)
      for (int i = 0; i < 8; i += 2) {
        p = _mm512_dpbusd_epi32(p, w[i], broadcast4(v + 4 * i));
        q = _mm512_dpbusd_epi32(q, w[i + 1], broadcast4(v + 4 * i + 4));
      }
      isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_add_epi32(p, q), sc));
    }
  }
  lanes16_add<R>(isum, blk.d, x, m, b, accs);
}

template <int T, typename O>
void qlinear_lanes_iq4(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                       int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  static_assert(T == kIQ4_XS, "lanes_iq4");
  qlinear_lanes16<T, Lanes16BlockIQ4>(
      w, ldw, x, M, bias, out, ldo, n_begin, n_end, s,
      [](const uint8_t* const* p, int64_t at, Lanes16BlockIQ4& blk) { decode_block16_iq4(p, at, blk); },
      [&](const Lanes16BlockIQ4& blk, int64_t m, int64_t b, float* acc, auto r) {
        lanes16_rows_iq4<decltype(r)::value>(blk, x, m, b, acc);
      });
}
#else
constexpr bool lanes_iq4(int) { return false; }
template <int T, typename O>  // never called here (lanes_iq4): declared for qlinear_rows' discarded branch
void qlinear_lanes_iq4(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                       int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);
#endif

}  // namespace peregrine_quant
