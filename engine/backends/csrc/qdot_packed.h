// qdot.h's loop for the row-packed formats (quant.h: kQ4_0R / kQ4_1R / kQ8_0R): 64 weights a load, a row's
// scales converted eight at a time, and with one to three activation rows four weight rows at a time
// (qlinear_few_packed); the same sums in the same order as dot_rows, whatever the number of rows.
#pragma once

#include "qdot_rows.h"

namespace peregrine_quant {

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
// pair after the other; in a packed Q8_0 row, their 64 bytes (group g's 32, then g + 1's).
template <int T>
inline const uint8_t* nibbles_of(const uint8_t* row, int64_t g) {
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
// Value i (0-31) of group g of a packed row (Q8_0's signed, the others' unsigned).
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
// Eight groups' weight scales and minimums from group g of a packed row, in registers: n <= 8 of them (n even),
// lanes past n zero, as the scratch arrays hold them.
template <int T>
inline void scales8_regs(const uint8_t* row, int64_t K, int64_t groups, int64_t g, int64_t n, __m256& wd,
                         __m256& wm) {
  auto halves8 = [&](const uint8_t* p) {
    return n == 8 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                  : _mm256_cvtph_ps(_mm_maskload_epi32(reinterpret_cast<const int*>(p),
                                                       _mm256_castsi256_si128(lanes_below(n / 2))));
  };
  wd = halves8(row + scales_at<T>(K) + 2 * g);
  wm = T == kQ4_1R ? halves8(row + K / 2 + 2 * groups + 2 * g) : _mm256_mul_ps(_mm256_set1_ps(offset_min<T>()), wd);
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
  float *wd = s.wd.data(), *wm = s.mins.data(), *sc = s.sc.data();
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * ldw;
    if (n + ahead < n_end)
      for (int64_t o = 0; o < ldw; o += 64) __builtin_prefetch(row + ahead * ldw + o);
    halves_to_floats(row + scales_at<T>(K), groups, wd);
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

}  // namespace peregrine_quant
