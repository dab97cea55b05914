// Integer dot products against GGUF weights kept quantized, the way llama.cpp's vec_dot kernels compute them: a
// decode step's activations are quantized to int8 in blocks of 32 (one float scale each, as ggml's Q8_0/Q8_1),
// and each weight row is multiplied with them in int8 (AVX2: `vpmaddubsw` + `vpmaddwd`, 32 products an
// instruction), scaled and summed in float32. Used by the one-call decoder (decoder.cpp) and bound as `qlinear`.
//
// A row's weights are decoded in registers, 32 at a time, and each decoded group is multiplied with up to four
// activation rows before the next is decoded. The AVX2 body reads a 32-value block's scale from the block as it
// goes; other builds read a row's scales into a small float array first. 4-bit weights stay unsigned (Q4_0's offset
// of 8 becomes a minimum, as Q4_1's), so `vpmaddubsw` takes them as they are; signed ones (Q8_0) go through the sign
// trick. The next rows are prefetched: one step streams every weight once.
//
// Q4_0, Q4_1 and Q8_0 are packed by rows at load (quant.h: kQ4_0R / kQ4_1R / kQ8_0R): one 32-byte load gives 64
// 4-bit weights (a 64-byte load 64 8-bit ones), and a row's scales are converted eight at a time and multiplied with
// each activation row's in one pass, so the loop over groups is loads, two shifts/masks and the int8 dot
// (`dot_packed`). Its sums are those of the file's layout, except packed Q8_0's in the AVX-512 build (kUnsignedQ8).
// With one to three activation rows (a decode step of one to three requests), four weight rows go through that loop
// together, their scales converted in registers eight groups at a time (`qlinear_few_packed`): the same sums, with
// four rows' independent chains in flight instead of one row's prologue, loop and reductions one after the other
// (1.45x at one row on AVX-512). In the AVX-512 builds packed Q4_0 / Q4_1 / Q8_0 take qdot_lanes.h instead: 16 weight
// rows at a time, one a 32-bit lane (a group's conversion, scale and FMA shared by 16 rows), for every number of
// activation rows; its own order of float sums (not the file layout's bits), the same for a row in any batch. There
// the engine hands the decoder those weights, and Q4_K's, Q6_K's and Q5_0's, tiled (quant.h: kQ4_0T ...;
// qlinear_tiles, qlinear_tiles_k, qlinear_tiles_q6, qlinear_tiles_q5): each 16 rows interleaved as the 16-lane loops
// read them, so they load a tile front to back and shuffle nothing (Q5_0: nothing but its fifth bits).
//
// The K-quants (Q4_K, Q5_K, Q6_K) and IQ4_XS are multiplied as the file stores them, against activations quantized in
// blocks of 256 instead (ggml's Q8_K): a super-block's sums stay in integers, its group scales applied by `vpmaddwd`,
// and one float FMA a super-block and activation row (qdot_kquant.h; the AVX-512 build takes two groups a 512-bit
// register there, the same integer sums). In the AVX-512 VNNI builds Q4_K goes 16 weight rows a lane each instead
// (qdot_lanes_k.h), and so do Q6_K (qdot_lanes_q6.h), IQ4_XS (qdot_lanes_iq4.h) and Q5_0 (qdot_lanes_q5.h): their
// own order of float sums, the same for a row in any batch; in the other AVX2 builds Q4_K and Q6_K go eight weight
// rows a lane each (qdot_lanes8.h), the same float operations as the 16-lane loops, so the same bits, and with
// AVX-VNNI IQ4_XS too (as qdot_lanes_iq4.h, for every number of activation rows). IQ4_NL goes
// through the 32-value loop as a signed format (its nibbles looked up in its table by one `vpshufb`,
// qdot_formats.h).
//
// Each output element is the same instruction sequence in the same order whatever the number of rows, the thread
// split or the tile position: results are batch invariant. Decoding has an AVX2 body (also used by the AVX-512
// build, which multiplies with AVX-512 VNNI's `vpdpbusd`: the same integer sums) and a portable one, and so has the
// dot.
//
// The pieces, each including the one before: qdot_act.h (the activations quantized), qdot_formats.h (each format's
// scales and weights decoded), qdot_rows.h (the row loop for the file's layouts), qdot_packed.h (the loop for the
// row-packed layouts), qdot_kquant.h (the K-quants'), qdot_lanes.h (packed Q4_0 / Q4_1 / Q8_0, AVX-512), with
// qdot_lanes_k.h (Q4_K), qdot_lanes_q6.h (Q6_K), qdot_lanes_iq4.h (IQ4_XS) and qdot_lanes_q5.h (Q5_0) beside it,
// and qdot_lanes8.h (Q4_K and Q6_K, AVX2 without AVX-512 VNNI); this file picks one per format (qlinear_rows).
#pragma once

#include "qdot_lanes8.h"
#include "qdot_lanes_iq4.h"
#include "qdot_lanes_k.h"
#include "qdot_lanes_q5.h"
#include "qdot_lanes_q6.h"

namespace peregrine_quant {

// Row r of a tiled weight (quant.h: kQ4_0T ...) as its packed row (ldw bytes): its dwords of values and its scale
// halves gathered from its tile.
inline void untile_row(int type, const uint8_t* w, int64_t ldw, int64_t r, int64_t K, uint8_t* row) {
  const int64_t j = r % kTileRows;
  const uint8_t* tile = w + (r - j) * ldw;
  if (type == kQ4_KT || type == kQ5_KT || type == kQ6_KT || type == kQ5_0T) {  // a block's dwords interleaved,
    const Layout l = layout_of(type);  // then its f16 d (Q6_K's last, Q5_0's first: moved last in the tile)
    const int64_t head = type == kQ5_0T ? 2 : 0, dwords = (l.bytes - head) / 4;
    for (int64_t b = 0; b < K / l.elems; ++b) {
      const uint8_t* t = tile + kTileRows * l.bytes * b;
      uint8_t* o = row + l.bytes * b;
      for (int64_t i = 0; i < dwords; ++i) std::memcpy(o + head + 4 * i, t + 64 * i + 4 * j, 4);
      if (l.bytes % 4) std::memcpy(head ? o : o + 4 * dwords, t + 64 * dwords + 2 * j, 2);
    }
    return;
  }
  const int64_t values = type == kQ8_0T ? K : K / 2;
  for (int64_t c = 0; c < values / 32; ++c)
    for (int64_t i = 0; i < 8; ++i) std::memcpy(row + 32 * c + 4 * i, tile + 512 * c + 64 * i + 4 * j, 4);
  for (int64_t h = 0; h < (ldw - values) / 2; ++h)
    std::memcpy(row + values + 2 * h, tile + kTileRows * values + 32 * h + 2 * j, 2);
}

// Tiled weights in a build without the 16-lane loops (tile_rows() 0: another engine on the same model, of a level
// with them, tiled its weights first): each tile met gathered back into rows, then multiplied as rows (their bits).
template <typename O>
void qlinear_untiling(int type, const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s);

template <typename O>
void qlinear_rows(int type, const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                  int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  switch (type) {
    case kQ4_0: return qlinear_range<kQ4_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_1: return qlinear_range<kQ4_1>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ5_0:
      if constexpr (lanes_q5(kQ5_0))  // (pairs of groups: rows of a multiple of 64 values)
        if (x.K % 64 == 0)
          return qlinear_lanes_q5<kQ5_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_range<kQ5_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ5_1: return qlinear_range<kQ5_1>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ8_0: return qlinear_range<kQ8_0>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_K:
      if constexpr (lanes_k(kQ4_K)) return qlinear_lanes_k<kQ4_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      if constexpr (lanes_k8(kQ4_K)) return qlinear_lanes_k8<kQ4_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_range_k<kQ4_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end);
    case kQ5_K:
      if constexpr (lanes_k(kQ5_K)) return qlinear_lanes_k<kQ5_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_range_k<kQ5_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end);
    case kQ6_K:
      if (M >= kLanesQ6Rows) {  // (fewer rows: the row loop, the same bits)
        if constexpr (lanes_q6(kQ6_K)) return qlinear_lanes_q6<kQ6_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
        if constexpr (lanes_k8(kQ6_K)) return qlinear_lanes_k8<kQ6_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      }
      return qlinear_range_k<kQ6_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end);
    case kIQ4_NL: return qlinear_range<kIQ4_NL>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kIQ4_XS:
      if constexpr (lanes_iq4(kIQ4_XS))  // (every number of rows: qdot_lanes_iq4.h)
        return qlinear_lanes_iq4<kIQ4_XS>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      if constexpr (lanes_k8(kIQ4_XS))  // (AVX-VNNI; every number of rows, as qdot_lanes_iq4.h's)
        return qlinear_lanes_k8<kIQ4_XS>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_range_k<kIQ4_XS>(w, ldw, x, M, bias, out, ldo, n_begin, n_end);
    case kQ4_0R:
      if constexpr (lanes_packed(kQ4_0R)) return qlinear_lanes<kQ4_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_range_packed<kQ4_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_1R:
      if constexpr (lanes_packed(kQ4_1R)) return qlinear_lanes<kQ4_1R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_range_packed<kQ4_1R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ8_0R:
      if constexpr (lanes_packed(kQ8_0R)) return qlinear_lanes<kQ8_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_range_packed<kQ8_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_0T:
      if constexpr (lanes_packed(kQ4_0R)) return qlinear_tiles<kQ4_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_untiling(type, w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_1T:
      if constexpr (lanes_packed(kQ4_1R)) return qlinear_tiles<kQ4_1R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_untiling(type, w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ8_0T:
      if constexpr (lanes_packed(kQ8_0R)) return qlinear_tiles<kQ8_0R>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_untiling(type, w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ5_0T:  // (tiled only where rows are a multiple of 64 values: quant.py)
      if constexpr (lanes_q5(kQ5_0))
        if (x.K % 64 == 0) return qlinear_tiles_q5(w, ldw, x, M, bias, out, ldo, n_begin, n_end);
      return qlinear_untiling(type, w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ4_KT:
      if constexpr (lanes_k(kQ4_K)) return qlinear_tiles_k<kQ4_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_untiling(type, w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ5_KT:
      if constexpr (lanes_k(kQ5_K)) return qlinear_tiles_k<kQ5_K>(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_untiling(type, w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    case kQ6_KT:
      if constexpr (lanes_q6(kQ6_K)) return qlinear_tiles_q6(w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
      return qlinear_untiling(type, w, ldw, x, M, bias, out, ldo, n_begin, n_end, s);
    default: return;  // the callers check the type first (supported())
  }
}

// Whether qlinear_rows takes `type` (the tiled forms in every build: qlinear_untiling where the 16-lane loops are not).
inline bool supported(int64_t type) { return layout_of(static_cast<int>(type)).elems > 0; }

template <typename O>
void qlinear_untiling(int type, const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out,
                      int64_t ldo, int64_t n_begin, int64_t n_end, QScratch& s) {
  std::vector<uint8_t> rows(kTileRows * ldw);
  for (int64_t n = n_begin / kTileRows * kTileRows; n < n_end; n += kTileRows) {
    for (int64_t j = 0; j < kTileRows; ++j) untile_row(type, w, ldw, n + j, x.K, rows.data() + j * ldw);
    qlinear_rows(untiled(type), rows.data(), ldw, x, M, bias ? bias + n : nullptr, out + n, ldo,
                 std::max(n, n_begin) - n, std::min(n + kTileRows, n_end) - n, s);
  }
}

// The rows of a tile where this build multiplies tiled weights (kTileRows), else 0: bound as `tile_rows`, the loader's
// cue to tile (engine/model/quant.py).
inline int64_t tile_rows() { return lanes_packed(kQ4_1R) ? kTileRows : 0; }

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
    case kQ5_K: return rows(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return rows(std::integral_constant<int, kQ6_K>{});
    case kIQ4_NL: return rows(std::integral_constant<int, kIQ4_NL>{});
    case kIQ4_XS: return rows(std::integral_constant<int, kIQ4_XS>{});
    case kQ4_0R: return rows(std::integral_constant<int, kQ4_0R>{});
    case kQ4_1R: return rows(std::integral_constant<int, kQ4_1R>{});
    case kQ8_0R: return rows(std::integral_constant<int, kQ8_0R>{});
    default: return;
  }
}

// Row r of an embedding table `w` (rows of ldw bytes) kept quantized, as float32; a tiled one's through its packed row.
inline void dequant_row_at(int type, const uint8_t* w, int64_t ldw, int64_t r, int64_t K, float* out) {
  if (!tiled(type)) return dequant_row(type, w + r * ldw, K, out);
  thread_local std::vector<uint8_t> row;  // one per thread, reused: a lookup a token
  row.resize(ldw);
  untile_row(type, w, ldw, r, K, row.data());
  dequant_row(untiled(type), row.data(), K, out);
}

}  // namespace peregrine_quant
