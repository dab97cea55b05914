// qdot.h's row loop for every format in the file's layout: a weight row's groups multiplied with up to four
// activation rows at a time (dot_rows), kAccs FMA chains a row summed in a fixed order, and qlinear_range, which
// runs it over a thread's share of the output rows with the weight stream prefetched ahead.
#pragma once

#include "qdot_formats.h"

namespace peregrine_quant {

// FMA chains a row in the int8 dot loops (dot_rows, dot_packed). Four on AVX-512 builds, where a pair of groups
// takes one FMA and one chain's latency bounds a row at one activation row (one thread, L2-resident packed Q4_1
// rows, AMD EPYC Zen 5: 28.7-29.4 against 33.1 ns a row at K = 1536, 100-107 against 120-122 at K = 4608, the same
// at K = 576). Two elsewhere: the AVX2 loop has more instructions a pair, and four chains only added work there
// (18.3-18.9 against 16.5-17.3 ns a row at K = 576, same CPU).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__FMA__)  // dot_packed's 512-bit loop
constexpr int kAccs = 4;
#else
constexpr int kAccs = 2;
#endif

#if defined(__AVX2__)
// Lanes [0, n) of eight set (n <= 8): the mask of a last, partial chunk of eight groups.
inline __m256i lanes_below(int64_t n) {
  static const int32_t table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table + 8 - n));
}
// sum_g mins[g] * s[g] over g < n, eight lanes at a time (a partial last chunk read masked: nothing past n).
inline float mins_dot(const float* mins, const float* s, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= n; g += 8) acc = madd8(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(s + g), acc);
  if (g < n) {
    const __m256i mask = lanes_below(n - g);
    acc = madd8(_mm256_maskload_ps(mins + g, mask), _mm256_maskload_ps(s + g, mask), acc);
  }
  return hsum8(acc);
}
#endif

// res[r] += sum_g mins[g] * s[g] for activation row m0 + r (a weight row's per-group minimums times the activation
// groups' sums): eight lanes at a time with AVX2, in order elsewhere.
template <int R>
inline void add_mins(const float* mins, const QRows& x, int64_t m0, float* res) {
  const int64_t blocks = x.K / kQK;
  for (int r = 0; r < R; ++r) {
    const float* s = x.s + (m0 + r) * blocks;
#if defined(__AVX2__)
    res[r] += mins_dot(mins, s, blocks);
#else
    for (int64_t g = 0; g < blocks; ++g) res[r] += mins[g] * s[g];
#endif
  }
}

// res[r] = sum_k w[k] * x[m0 + r][k] for r < R, one weight row (its blocks at `row`) given group by group by
// `wsrc(g)`. Its scales and minimums are in wd / mins already, except where `scales_inline(T)`: then each group's
// scale is read from its block here, and its minimum written to mins[g] for the sum at the end. kAccs accumulators
// a row (group g into the (g mod kAccs)th) keep that many FMA chains in flight, summed as acc0 + acc1, or with four
// as (acc0 + acc2) + (acc1 + acc3); the order of the sums is fixed, whatever R.
template <int T, int R, typename Src>
inline void dot_rows(const Src& wsrc, const uint8_t* row, const float* wd, float* mins, const QRows& x, int64_t m0,
                     float* res) {
  const int64_t K = x.K, blocks = K / kQK;
#if defined(__AVX2__)
  __m256 acc[kAccs][R];
  for (int j = 0; j < kAccs; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  auto group = [&](int64_t g, __m256* acc) {
    const __m256i w = wsrc(g), wu = is_signed(T) ? _mm256_sign_epi8(w, w) : w;  // |w| for the signed formats
    float sw;  // the group's (first) scale
    if constexpr (scales_inline(T))
      scales_block<T>(row + g * layout_of(T).bytes, &sw, mins + g);
    else
      sw = wd[g];
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + m * K + g * kQK));
      const __m256i p = dot_u8s8(wu, is_signed(T) ? _mm256_sign_epi8(a, w) : a);  // |w| times a with w's sign
      const float da = x.d[m * blocks + g];
      acc[r] = madd8(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sw * da), acc[r]);
    }
  };
  int64_t g = 0;
  for (; g + kAccs <= blocks; g += kAccs)
    for (int j = 0; j < kAccs; ++j) group(g + j, acc[j]);
  for (int j = 0; g < blocks; ++g, ++j) group(g, acc[j]);
  for (int r = 0; r < R; ++r)
    res[r] = hsum8(kAccs == 4 ? _mm256_add_ps(_mm256_add_ps(acc[0][r], acc[2][r]), _mm256_add_ps(acc[1][r], acc[3][r]))
                              : _mm256_add_ps(acc[0][r], acc[1][r]));
#else
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float lanes[2][8] = {};
    for (int64_t g = 0; g < blocks; ++g) {
      const W32 w = wsrc(g);
      const int8_t* a = x.q + m * K + g * kQK;
      const float scale = wd[g] * x.d[m * blocks + g];
      for (int lane = 0; lane < 8; ++lane) {
        int32_t p = 0;
        for (int i = 0; i < 4; ++i) p += static_cast<int32_t>(w.v[4 * lane + i]) * a[4 * lane + i];
        lanes[g & 1][lane] += static_cast<float>(p) * scale;
      }
    }
    float l[8];
    for (int i = 0; i < 8; ++i) l[i] = lanes[0][i] + lanes[1][i];
    res[r] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  }
#endif
  if constexpr (has_min(T)) add_mins<R>(mins, x, m0, res);
}

// How many rows ahead of the one multiplied are prefetched: 4, and with few activation rows (where a step streams
// the weights as fast as memory gives them) at least 4 KiB ahead, 8 KiB at one row, so short rows (a Q4_1 row of
// 576 weights is 360 bytes) keep enough lines in flight to cover the memory's latency. A thread's share of a matmul
// starts with its first `ahead` rows requested at once (prefetch_first), not on cold memory. One-row decode step of
// the bundled SmolLM2 Q4_1 on an AMD EPYC Zen 5, 2 threads, alternating in one process: 2252 against 2446 us
// (AVX-512 build), 2637 against 2754 us (AVX2 build), against 4 KiB and no first rows; 8 KiB without the first rows
// was as slow as 4 KiB, and at three activation rows (bound by the dot products) 8 KiB was not faster.
// (`one_row_bytes`: the K-quants' rows, 1-2 KB, are prefetched 4 KiB ahead at one row too. One-row decode on an AMD
// EPYC Zen 4, 2 threads, rounds alternating in separate processes, medians of 3: Llama-3.2-1B Q4_K_M 36.6, 34.5,
// 34.9 against 33.4, 33.1, 33.4 tok/s, 16 and 32 KiB slower still; Qwen2.5-1.5B Q4_K_M 28.7, 28.9, 26.1 against
// 28.2, 28.3, 26.4.)
inline int64_t prefetch_rows(int64_t row_bytes, int64_t activation_rows, int64_t one_row_bytes = 8192) {
  if (activation_rows > 4) return 4;
  const int64_t bytes = activation_rows == 1 ? one_row_bytes : 4096;
  return std::max<int64_t>(4, (bytes + row_bytes - 1) / row_bytes);
}
inline void prefetch_first(const uint8_t* w, int64_t ldw, int64_t n_begin, int64_t n_end, int64_t ahead) {
  const int64_t end = std::min(n_end, n_begin + ahead) * ldw;
  for (int64_t o = n_begin * ldw; o < end; o += 64) __builtin_prefetch(w + o);
}

// out[m * ldo + n] = x[m] . W[n] (+ bias[n]) for n in [n_begin, n_end), m < M; W's rows of blocks `ldw` bytes apart.
template <int T, typename O>
void qlinear_range(const uint8_t* w, int64_t ldw, const QRows& x, int64_t M, const float* bias, O* out, int64_t ldo,
                   int64_t n_begin, int64_t n_end, QScratch& s) {
  constexpr Layout L = layout_of(T);
  static_assert(L.elems == kQK, "dot_rows takes formats with a scale per 32 values");
  const int64_t K = x.K, nb = K / L.elems;
  const int64_t ahead = prefetch_rows(ldw, M);
  s.row_buffers(K);
  float *wd = s.wd.data(), *mins = s.mins.data();
  prefetch_first(w, ldw, n_begin, n_end, ahead);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * ldw;
    if (n + ahead < n_end)
      for (int64_t o = 0; o < ldw; o += 64) __builtin_prefetch(row + ahead * ldw + o);
    if constexpr (!scales_inline(T))
      for (int64_t b = 0; b < nb; ++b) scales_block<T>(row + b * L.bytes, wd + b, mins + b);
    const float bn = bias ? bias[n] : 0.f;
    float res[4];
    int64_t m = 0;
    auto put = [&](int count) {  // groups of four rows, then two, then one
      for (int r = 0; r < count; ++r) out[(m + r) * ldo + n] = static_cast<O>(res[r] + bn);
      m += count;
    };
    auto rows = [&](const auto& src) {
      while (m + 4 <= M) dot_rows<T, 4>(src, row, wd, mins, x, m, res), put(4);
      if (m + 2 <= M) dot_rows<T, 2>(src, row, wd, mins, x, m, res), put(2);
      if (m < M) dot_rows<T, 1>(src, row, wd, mins, x, m, res), put(1);
    };
#if defined(__AVX2__)
    if (M > 4) {  // the row's weights decoded once, not once for every four activation rows: the same values
      int8_t* wq = s.wq.data();
      for (int64_t g = 0; g < nb; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + g * kQK), weights32<T>(row + g * L.bytes));
      rows([&](int64_t g) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + g * kQK)); });
      continue;
    }
#endif
    rows([&](int64_t g) { return weights32<T>(row + g * L.bytes); });
  }
}

}  // namespace peregrine_quant
