// Peregrine's CPU kernels (AVX-512; the linear also needs AVX512-BF16), built by engine/cpu_kernels.py.
//
// linear_bf16: small-batch bfloat16 linear, out[M, N] = x[M, K] @ w[N, K]^T (+ bias).
// Decoding a few rows at a time is a matrix-vector product: every weight is read once per step and used M
// times, so the step is bound by memory bandwidth. oneDNN's bf16 GEMM reaches a fraction of it at M = 1; this
// streams each weight row once through `vdpbf16ps` (bf16 pairs multiplied, accumulated in float32), R rows at
// a time, for up to 8 inputs per pass. Each output element is computed by the same instructions in the same order
// whatever M is, so a sequence's logits do not depend on its batch mates.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <omp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kStep = 32;  // bf16 elements per 512-bit register

template <int M, int R>
void rows_block(const uint16_t* x, const uint16_t* w, const float* bias, c10::BFloat16* out,
                int64_t K, int64_t N, int64_t n0, int64_t ldx) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float v = _mm512_reduce_add_ps(acc[m][r]);
      if (bias) v += bias[n0 + r];
      out[m * N + n0 + r] = c10::BFloat16(v);
    }
}

// Output columns [n_begin, n_end) for M <= 8 input rows, R weight rows at a time. Each output element is the same
// instruction sequence whatever R, M or the range boundaries are.
template <int M>
void gemv_range(const uint16_t* x, const uint16_t* w, const float* bias, c10::BFloat16* out, int64_t K, int64_t ldx,
                int64_t ldo, int64_t n_begin, int64_t n_end) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);  // accumulators M * R + loads stay within 32 registers
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) rows_block<M, R>(x, w, bias, out, K, ldo, n, ldx);
  for (; n < n_end; ++n) rows_block<M, 1>(x, w, bias, out, K, ldo, n, ldx);
}

// gemv_range for `rows` (1-8) input rows.
void gemv_rows(int64_t rows, const uint16_t* x, const uint16_t* w, const float* bias, c10::BFloat16* out, int64_t K,
               int64_t ldx, int64_t ldo, int64_t n_begin, int64_t n_end) {
  switch (rows) {
    case 1: gemv_range<1>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
    case 2: gemv_range<2>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
    case 3: gemv_range<3>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
    case 4: gemv_range<4>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
    case 5: gemv_range<5>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
    case 6: gemv_range<6>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
    case 7: gemv_range<7>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
    default: gemv_range<8>(x, w, bias, out, K, ldx, ldo, n_begin, n_end); break;
  }
}

}  // namespace

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bfloat16 only");
  TORCH_CHECK(w.is_contiguous() && x.stride(1) == 1, "linear_bf16: contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kStep == 0, "linear_bf16: K must be a multiple of 32");
  TORCH_CHECK(M >= 1, "linear_bf16: at least one row");
  torch::Tensor b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, N}, x.options());
  auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0);
  // Up to 8 rows share one pass over the weights; more rows take further passes, 8 at a time.
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t rows = std::min<int64_t>(M - m0, 8);
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      gemv_rows(rows, xp + m0 * ldx, wp, bp, op + m0 * N, K, ldx, N, begin, end);
    });
  }
  return out;
}

namespace {

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bf16 is float's top half
}

// e^x for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^floor * 2^frac, the fraction by its
// Taylor series to degree 8 (relative error about 1e-7, float32's own).
__attribute__((always_inline)) inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);  // [0, 1)
  static constexpr float c[] = {1.f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                                0.009618129107628477f, 0.0013333558146428443f, 0.00015403530393381606f,
                                1.525273380405984e-05f, 1.3215486790144307e-06f};
  __m512 p = _mm512_set1_ps(c[8]);
  for (int k = 7; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[k]));
  return _mm512_scalef_ps(p, whole);
}

// The 16 horizontal sums of v[0..15] as one vector (a transpose by shuffles instead of 16 reductions).
__attribute__((always_inline)) inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] and v[2i+1] folded to pairs
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per lane: the lane's sums of v[4j..4j+3]
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Decode attention in fixed chunks of context positions (flash-decoding's split): a work item is one sequence, one
// KV head and one chunk, for the whole GQA group of query heads that share the K and V rows; a merge then combines
// a head's chunks in order. Chunks are fixed by position, never by how many sequences or threads there are, so a
// sequence's attention output is the same bits whatever its batch mates, and one long sequence still keeps every
// thread busy.
constexpr int64_t kAttnChunk = 64;

inline int64_t attn_chunks(int64_t len) { return (len + kAttnChunk - 1) / kAttnChunk; }

// Per (sequence, query head, chunk): dim floats of the weighted V sum relative to the chunk's max score, then that
// max, then the chunk's sum of exp(score - max).
struct AttnPartials {
  std::vector<float> data;
  int64_t heads = 0, cap = 0, dim = 0;
  void reset(const int64_t* lengths, int64_t batch, int64_t h, int64_t d) {
    heads = h, cap = batch ? attn_chunks(*std::max_element(lengths, lengths + batch)) : 0, dim = d;
    data.resize(static_cast<size_t>(batch * heads * cap * (dim + 2)));
  }
  float* at(int64_t b, int64_t h, int64_t chunk) { return data.data() + ((b * heads + h) * cap + chunk) * (dim + 2); }
};

struct AttnItem {
  int64_t b, kvh, chunk;
};

// Every (sequence, KV head, chunk) of a step, in a fixed order.
inline std::vector<AttnItem> attn_items(const int64_t* lengths, int64_t batch, int64_t kv_heads) {
  std::vector<AttnItem> items;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t c = 0; c < attn_chunks(lengths[b]); ++c) items.push_back({b, kvh, c});
  return items;
}

// Scratch for one thread's attention items, reused across items.
struct AttnScratch {
  std::vector<float> scores;
  std::vector<__m512> qv, acc;
};

// The softmax numerators exp(score - max) of each head's chunk scores, in place; the max and their sum go to the
// head's partial.
__attribute__((always_inline)) inline void chunk_softmax(float* scores, float* part, int64_t dim) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t o = 0; o < kAttnChunk; o += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(scores + o));
  const float max = _mm512_reduce_max_ps(vmax);
  __m512 total = _mm512_setzero_ps();
  for (int64_t o = 0; o < kAttnChunk; o += 16) {  // the -inf padding becomes 0
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + o), _mm512_set1_ps(max)));
    _mm512_storeu_ps(scores + o, e);
    total = _mm512_add_ps(total, e);
  }
  part[dim] = max;
  part[dim + 1] = _mm512_reduce_add_ps(total);
}

// One chunk for GP query heads of a GQA group (from g0), head_dim = CH * 16 known at compile time: the query
// vectors and the V accumulators stay in registers and the dot products of 16 positions are independent chains.
// The arithmetic and its order are attend_generic's, so both give the same bits.
template <int CH, int GP, typename T>
void attend_heads(int64_t b, int64_t h0, int64_t chunk, const T* q, const T* const* k_rows, const T* const* v_rows,
                  int64_t n, int64_t heads, float scale, AttnPartials& partials) {
  constexpr int64_t dim = CH * 16;
  __m512 qv[GP][CH];
  for (int g = 0; g < GP; ++g)
    for (int c = 0; c < CH; ++c)
      qv[g][c] = _mm512_mul_ps(load16(q + (b * heads + h0 + g) * dim + c * 16), _mm512_set1_ps(scale));
  alignas(64) float scores[GP][kAttnChunk];
  for (int g = 0; g < GP; ++g) std::fill_n(scores[g], kAttnChunk, -INFINITY);
  for (int64_t o0 = 0; o0 < n; o0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - o0);
    const T* const* rows = k_rows + o0;  // past the end: the last row again, masked
    for (int g = 0; g < GP; ++g) {
      __m512 dots[16];
      for (int o = 0; o < 16; ++o) {
        const T* r = rows[std::min<int64_t>(o, m - 1)];
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < CH; ++c) dot = _mm512_fmadd_ps(qv[g][c], load16(r + c * 16), dot);
        dots[o] = dot;
      }
      _mm512_mask_storeu_ps(scores[g] + o0, static_cast<__mmask16>((1u << m) - 1), sum16(dots));
    }
  }
  for (int g = 0; g < GP; ++g) chunk_softmax(scores[g], partials.at(b, h0 + g, chunk), dim);
  __m512 acc[GP][CH];
  for (int g = 0; g < GP; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t o = 0; o < n; ++o) {
    const T* vp = v_rows[o];
    for (int c = 0; c < CH; ++c) {
      const __m512 v = load16(vp + c * 16);
      for (int g = 0; g < GP; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][o]), v, acc[g][c]);
    }
  }
  for (int g = 0; g < GP; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(partials.at(b, h0 + g, chunk) + c * 16, acc[g][c]);
}

// attend_heads for `count` (1..GP) heads: the instantiation with that many.
template <int CH, int GP, typename T>
void attend_pass(int64_t count, int64_t b, int64_t h0, int64_t chunk, const T* q, const T* const* k_rows,
                 const T* const* v_rows, int64_t n, int64_t heads, float scale, AttnPartials& partials) {
  if (count == GP) attend_heads<CH, GP, T>(b, h0, chunk, q, k_rows, v_rows, n, heads, scale, partials);
  else if constexpr (GP > 1) attend_pass<CH, GP - 1, T>(count, b, h0, chunk, q, k_rows, v_rows, n, heads, scale, partials);
}

// Any head_dim (a multiple of 16): the same arithmetic as attend_heads, with the sizes known only at run time.
template <typename T>
void attend_generic(int64_t b, int64_t h0, int64_t group, int64_t chunk, const T* q, const T* const* k_rows,
                    const T* const* v_rows, int64_t n, int64_t heads, int64_t dim, float scale, AttnPartials& partials,
                    AttnScratch& s) {
  const int64_t chunks = dim / 16;
  s.scores.assign(group * kAttnChunk, -INFINITY);
  s.qv.resize(group * chunks);
  s.acc.assign(group * chunks, _mm512_setzero_ps());
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      s.qv[g * chunks + c] = _mm512_mul_ps(load16(q + ((b * heads + h0 + g) * dim) + c * 16), _mm512_set1_ps(scale));
  for (int64_t o0 = 0; o0 < n; o0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - o0);
    for (int64_t g = 0; g < group; ++g) {
      __m512 dots[16];
      for (int o = 0; o < 16; ++o) {
        const T* r = k_rows[o0 + std::min<int64_t>(o, m - 1)];
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) dot = _mm512_fmadd_ps(s.qv[g * chunks + c], load16(r + c * 16), dot);
        dots[o] = dot;
      }
      _mm512_mask_storeu_ps(s.scores.data() + g * kAttnChunk + o0, static_cast<__mmask16>((1u << m) - 1), sum16(dots));
    }
  }
  for (int64_t g = 0; g < group; ++g) chunk_softmax(s.scores.data() + g * kAttnChunk, partials.at(b, h0 + g, chunk), dim);
  for (int64_t o = 0; o < n; ++o) {
    const T* vp = v_rows[o];
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 v = load16(vp + c * 16);
      for (int64_t g = 0; g < group; ++g)
        s.acc[g * chunks + c] = _mm512_fmadd_ps(_mm512_set1_ps(s.scores[g * kAttnChunk + o]), v, s.acc[g * chunks + c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(partials.at(b, h0 + g, chunk) + c * 16, s.acc[g * chunks + c]);
}

// Per query head of the item's GQA group: the chunk's scores (16 positions at a time, one vector per head), softmax
// numerators, weighted V sum. Head dims of 32, 64 and 128 take the register-resident attend_heads, a few heads
// at a time; others the generic loop.
template <typename T>
void attend_chunk(const AttnItem& item, const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                  const int64_t* lengths, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_blocks,
                  int64_t block_size, float scale, AttnPartials& partials, AttnScratch& s) {
  const int64_t b = item.b, kvh = item.kvh, group = heads / kv_heads, h0 = kvh * group;
  const int64_t* table = block_tables + b * max_blocks;
  const int64_t p_begin = item.chunk * kAttnChunk, n = std::min(kAttnChunk, lengths[b] - p_begin);
  const T* k_rows[kAttnChunk];
  const T* v_rows[kAttnChunk];
  for (int64_t o = 0, block = p_begin / block_size, slot = p_begin % block_size; o < n; ++o) {  // no division per row
    const int64_t at = ((table[block] * block_size + slot) * kv_heads + kvh) * dim;
    k_rows[o] = k_cache + at;
    v_rows[o] = v_cache + at;
    if (++slot == block_size) slot = 0, ++block;
  }
  // The rows come from memory (a step's weight stream evicts them): ask for all of the chunk's rows up front.
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < n; ++o)
    for (int64_t l = 0; l < row_bytes; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k_rows[o]) + l, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v_rows[o]) + l, _MM_HINT_T0);
    }
  auto passes = [&](auto ch, auto most) {
    constexpr int CH = decltype(ch)::value, GP = decltype(most)::value;
    for (int64_t g0 = 0; g0 < group; g0 += GP)
      attend_pass<CH, GP, T>(std::min<int64_t>(GP, group - g0), b, h0 + g0, item.chunk, q, k_rows, v_rows, n, heads,
                             scale, partials);
  };
  if (dim == 32) passes(std::integral_constant<int, 2>{}, std::integral_constant<int, 8>{});
  else if (dim == 64) passes(std::integral_constant<int, 4>{}, std::integral_constant<int, 4>{});
  else if (dim == 128) passes(std::integral_constant<int, 8>{}, std::integral_constant<int, 2>{});
  else attend_generic(b, h0, group, item.chunk, q, k_rows, v_rows, n, heads, dim, scale, partials, s);
}

// out[b, h] from the head's chunks, combined in chunk order.
template <typename T>
void merge_chunks(int64_t b, int64_t h, const int64_t* lengths, T* out, int64_t heads, int64_t dim,
                  AttnPartials& partials) {
  const int64_t count = attn_chunks(lengths[b]);
  float max = -INFINITY, total = 0.f;
  for (int64_t c = 0; c < count; ++c) max = std::max(max, partials.at(b, h, c)[dim]);
  alignas(64) float acc[512] = {};
  for (int64_t c = 0; c < count; ++c) {
    const float* part = partials.at(b, h, c);
    const float w = std::exp(part[dim] - max);
    total += w * part[dim + 1];
    for (int64_t d = 0; d < dim; d += 16)
      _mm512_store_ps(acc + d, _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(part + d), _mm512_load_ps(acc + d)));
  }
  T* dst = out + (b * heads + h) * dim;
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] / total);
}

template <typename T>
void paged_decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                  const int64_t* lengths, T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                  int64_t max_blocks, int64_t block_size, float scale) {
  const std::vector<AttnItem> items = attn_items(lengths, batch, kv_heads);
  AttnPartials partials;
  partials.reset(lengths, batch, heads, dim);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    AttnScratch s;
    for (int64_t i = begin; i < end; ++i)
      attend_chunk(items[i], q, k_cache, v_cache, block_tables, lengths, heads, kv_heads, dim, max_blocks, block_size,
                   scale, partials, s);
  });
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) merge_chunks(i / heads, i % heads, lengths, out, heads, dim, partials);
  });
}

}  // namespace

// Decode attention straight from the paged cache: one query token per sequence, no gather, no padding.
// q [B, H, D]; k_cache, v_cache [slots, KVH, D]; block_tables [B, max_blocks] long; lengths [B] long (tokens
// of context, this step's included). Softmax in float32. Returns [B, H, D] in q's dtype.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& lengths, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_decode_attention: contiguous q [B, H, D], caches [slots, KVH, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and caches share a dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 512 && k_cache.size(2) == D && H % KVH == 0,
              "paged_decode_attention: head dim % 16 and <= 512, GQA");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B, "paged_decode_attention: one table and length per row");
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) {
    paged_decode(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
                 tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), B, H, KVH, D,
                 tables.size(1), block_size, s);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention: float32 or bfloat16");
    paged_decode(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                 lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, tables.size(1), block_size, s);
  }
  return out;
}

namespace {

template <typename T>
void add_rms_norm_row(T* hr, const T* dr, const T* weight, T* out, int64_t hidden, float eps) {
  float sumsq = 0.f;
  for (int64_t i = 0; i < hidden; ++i) {
    if (dr) hr[i] = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
    const float v = static_cast<float>(hr[i]);
    sumsq += v * v;
  }
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    const T normed = static_cast<T>(static_cast<float>(hr[i]) * inv);  // rounded to the model dtype, then
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));  // scaled
  }
}

template <typename T>
void add_rms_norm(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      add_rms_norm_row(h + r * hidden, delta ? delta + r * hidden : nullptr, weight, out + r * hidden, hidden, eps);
  });
}

}  // namespace

// Residual add and RMSNorm in one pass, with transformers' LlamaRMSNorm rounding: h += delta (in place, when
// given), then weight * to_dtype(h * rsqrt(mean(h^2) + eps)) with the statistics in float32. h, delta [rows, hidden].
torch::Tensor add_rms_norm_(torch::Tensor& h, const c10::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                            double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && weight.is_contiguous() && weight.numel() == h.size(1),
              "add_rms_norm_: contiguous h [rows, hidden], weight [hidden]");
  TORCH_CHECK(!delta.has_value() || (delta->is_contiguous() && delta->sizes() == h.sizes() &&
                                     delta->scalar_type() == h.scalar_type()), "add_rms_norm_: delta like h");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type(), "add_rms_norm_: weight in h's dtype");
  auto out = torch::empty_like(h);
  if (h.scalar_type() == at::kBFloat16) {
    add_rms_norm(h.data_ptr<c10::BFloat16>(), delta ? delta->data_ptr<c10::BFloat16>() : nullptr,
                 weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), h.size(0), h.size(1), eps);
  } else {
    TORCH_CHECK(h.scalar_type() == at::kFloat, "add_rms_norm_: float32 or bfloat16");
    add_rms_norm(h.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                 out.data_ptr<float>(), h.size(0), h.size(1), eps);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// LlamaDecoder: a whole decode step of a Llama-family model (Llama, SmolLM, Mistral, Qwen2) in one call.
//
// At batch 1 the weights are read once per token and everything else is tiny vectors, so what costs time besides
// the weight stream is per-op overhead: Python dispatch and waking the thread team for each of the ~15 ops of
// each layer. Here the step is one parallel region: the threads split each matmul's output rows and meet at a
// spin barrier between phases (as llama.cpp's thread pool does). The matmuls run on AMX tiles where the CPU has
// them (Sapphire Rapids and later): the decoder keeps a copy of the weights packed as B tiles in the order a step
// reads them (pack_weight), so the weight stream runs front to back near the plain read speed, and the step's
// 1-32 input rows are the A tiles, read in place. One instruction sequence serves every batch size, so a row's
// output does not depend on its batch mates. CPUs without AMX use the AVX512-BF16 rows above on the model's own
// weights (no copy).
// The rounding to bfloat16 follows engine/llama_fast.py op for op (RoPE, SiLU * up, norms, matmul outputs).

namespace {

using bf16 = c10::BFloat16;

bool amx_permitted() {
  // Linux hands the AMX tile state to a process only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  __asm__ __volatile__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
}

bool amx_available() { return cpu_has_amx_bf16() && amx_permitted(); }

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 accumulators C[m block][n block] (up to 16 input rows x 16 float32), 4-5 weights B (16 k-pairs x 16
// weight rows x 2 bf16), 6-7 inputs A (up to 16 input rows x 32 bf16). The A and C tiles hold exactly the pass's
// input rows, so nothing past the last row is read and no padded copy of the inputs is made.
void load_tile_config(int64_t rows) {
  TileConfig cfg;
  const uint8_t first = static_cast<uint8_t>(std::min<int64_t>(rows, 16)),
                second = static_cast<uint8_t>(rows > 16 ? rows - 16 : 16);
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[0] = cfg.rows[2] = cfg.rows[6] = first;
  cfg.rows[1] = cfg.rows[3] = cfg.rows[7] = second;
  _tile_loadconfig(&cfg);
}

constexpr int64_t kMPass = 32;          // input rows per pass over the weights (two A tiles)
constexpr int64_t kAheadBytes = 16384;  // software prefetch distance in the packed weight stream

// The weights as AMX reads them: per block of 32 rows (16 for a last odd block), for each 32-column step, the block's
// 1 or 2 B tiles ([16 k-pairs][16 rows][2 bf16], 1 KB each). A matmul then reads its weights strictly front to
// back, which the hardware prefetchers and one software prefetch a fixed distance ahead keep streaming. The block
// of rows [n, n + 32) starts at n * K, as in the [N, K] layout.
void pack_weight(const uint16_t* w, int64_t N, int64_t K, uint16_t* dst) {
  at::parallel_for(0, (N + 31) / 32, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * 32, count = n + 32 <= N ? 2 : 1;
      uint16_t* block = dst + n * K;
      for (int64_t kb = 0; kb < K / 32; ++kb)
        for (int64_t i = 0; i < count; ++i)
          for (int64_t p = 0; p < 16; ++p)
            for (int64_t j = 0; j < 16; ++j)
              for (int64_t e = 0; e < 2; ++e)
                block[((kb * count + i) * 16 + p) * 32 + j * 2 + e] = w[(n + i * 16 + j) * K + kb * 32 + p * 2 + e];
    }
  });
}

// C tiles for the packed block of `count` (1-2) x 16 weight rows at `wb` against input rows x (A tiles, stride ldx).
template <bool TWO_M>
void amx_block(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t K, int64_t count, float* c) {
  _tile_zero(0);
  _tile_zero(2);
  if (TWO_M) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const uint16_t* tiles = wb + kb * count * 512;
    const char* ahead = reinterpret_cast<const char*>(tiles) + kAheadBytes;
    for (int64_t line = 0; line < count * 16; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    _tile_loadd(6, x + kb * 32, ldx * 2);
    if (TWO_M) _tile_loadd(7, x + 16 * ldx + kb * 32, ldx * 2);
    _tile_loadd(4, tiles, 64);
    _tile_dpbf16ps(0, 6, 4);
    if (TWO_M) _tile_dpbf16ps(1, 7, 4);
    if (count == 2) {
      _tile_loadd(5, tiles + 512, 64);
      _tile_dpbf16ps(2, 6, 5);
      if (TWO_M) _tile_dpbf16ps(3, 7, 5);
    }
  }
  _tile_stored(0, c, 64);
  if (TWO_M) _tile_stored(1, c + 256, 64);
  if (count == 2) {
    _tile_stored(2, c + 512, 64);
    if (TWO_M) _tile_stored(3, c + 768, 64);
  }
}

// out[m, n:n+16] for one accumulator tile c ([rows][16]): + bias, rounded to bfloat16 (round to nearest even).
inline void store_tile(const float* c, const float* bias, int64_t n, int64_t m0, int64_t rows, bf16* out, int64_t ldo) {
  const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + m * 16), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + m) * ldo + n), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

struct Scratch {
  alignas(64) float c[1024];
  int64_t tile_rows = 0;  // the pass size the tile configuration holds (0: none loaded)
  AttnScratch attn;
};

struct Linear {
  torch::Tensor weight, bias;  // bias kept in float32, undefined when absent
  const uint16_t* packed = nullptr;  // the AMX layout (pack_weight), in the decoder's packed buffer
  int64_t N = 0, K = 0;
};

// out[:M, n_begin:n_end] = x[:M] @ w[n_begin:n_end]^T (+ bias). n_begin and n_end are multiples of 16; with AMX
// n_begin is a multiple of 32 and n_end one too or N.
void linear_rows(const Linear& L, const bf16* x, int64_t ldx, int64_t M, bf16* out, int64_t ldo, int64_t n_begin,
                 int64_t n_end, bool amx, Scratch& s) {
  const float* bias = L.bias.defined() ? L.bias.data_ptr<float>() : nullptr;
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  if (n_begin >= n_end) return;
  if (!amx) {
    const auto* w = reinterpret_cast<const uint16_t*>(L.weight.data_ptr());
    for (int64_t m0 = 0; m0 < M; m0 += 8)
      gemv_rows(std::min<int64_t>(M - m0, 8), xs + m0 * ldx, w, bias, out + m0 * ldo, L.K, ldx, ldo, n_begin, n_end);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMPass) {
    const int64_t mb = std::min<int64_t>(M - m0, kMPass);
    if (s.tile_rows != mb) {
      load_tile_config(mb);
      s.tile_rows = mb;
    }
    for (int64_t n = n_begin; n < n_end; n += 32) {
      const int64_t count = n + 32 <= L.N ? 2 : 1;
      if (mb > 16) amx_block<true>(xs + m0 * ldx, ldx, L.packed + n * L.K, L.K, count, s.c);
      else amx_block<false>(xs + m0 * ldx, ldx, L.packed + n * L.K, L.K, count, s.c);
      for (int64_t i = 0; i < count; ++i) {
        store_tile(s.c + i * 512, bias, n + i * 16, m0, std::min<int64_t>(mb, 16), out, ldo);
        if (mb > 16) store_tile(s.c + i * 512 + 256, bias, n + i * 16, m0 + 16, mb - 16, out, ldo);
      }
    }
  }
}

// One allocation for all packed weights, in the order a step reads them, on transparent huge pages where the
// kernel grants them (fewer TLB misses along the stream).
struct PackedBuffer {
  uint16_t* data = nullptr;
  explicit PackedBuffer(int64_t elements) {
    constexpr size_t huge = size_t(2) << 20;
    const size_t bytes = (static_cast<size_t>(elements) * 2 + kAheadBytes + huge - 1) / huge * huge;
    data = static_cast<uint16_t*>(std::aligned_alloc(huge, bytes));
    TORCH_CHECK(data, "LlamaDecoder: cannot allocate ", bytes, " bytes for the packed weights");
    madvise(data, bytes, MADV_HUGEPAGE);
  }
  ~PackedBuffer() { std::free(data); }
  PackedBuffer(const PackedBuffer&) = delete;
  PackedBuffer& operator=(const PackedBuffer&) = delete;
};

// A spin barrier for the step's thread team (a passive OpenMP barrier would sleep in the kernel at every phase).
struct SpinBarrier {
  int n = 1;
  std::atomic<int> arrived{0}, phase{0};
  void wait() {
    if (n == 1) return;
    const int p = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(p + 1, std::memory_order_release);
      return;
    }
    // A phase ends within microseconds of its mates when every thread has a core. When one has lost its core
    // (the server's event loop, a client on the same machine), spinning on would keep it off: yield soon.
    for (int spins = 0; phase.load(std::memory_order_acquire) == p; ++spins) {
      if (spins < 256) _mm_pause();
      else sched_yield();
    }
  }
};

// [begin, end) of thread t's share of `units` * `align` items.
inline std::pair<int64_t, int64_t> share(int64_t items, int64_t align, int t, int threads) {
  const int64_t units = items / align;
  return {units * t / threads * align, units * (t + 1) / threads * align};
}

// transformers' rotate-half RoPE in bfloat16: to_bf16(to_bf16(x * cos) + to_bf16(rotate_half(x) * sin)).
inline void rope_head(const bf16* x, const bf16* cos, const bf16* sin, bf16* dst, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const bf16 a = static_cast<bf16>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const bf16 b = static_cast<bf16>(rotated * static_cast<float>(sin[i]));
    dst[i] = static_cast<bf16>(static_cast<float>(a) + static_cast<float>(b));
  }
}


// act = to_bf16(to_bf16(silu(gate)) * up), 16 elements.
inline void silu_mul16(const bf16* gate, const bf16* up, bf16* act) {
  const __m512 g = load16(gate), u = load16(up), one = _mm512_set1_ps(1.f);
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // exp(-|g|)
  const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
  const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 sigmoid = _mm512_mask_blend_ps(positive, _mm512_mul_ps(e, inv), inv);
  __m256bh silu = _mm512_cvtneps_pbh(_mm512_mul_ps(g, sigmoid));
  const __m512 silu32 = load16(reinterpret_cast<const bf16*>(&silu));
  const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(silu32, u));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(act), (__m256i)r);
}

struct DecoderLayer {
  torch::Tensor input_norm, post_norm, k_cache, v_cache;
  Linear qkv, o, gate_up, down;
};

Linear make_linear(const torch::Tensor& w, const torch::Tensor& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "LlamaDecoder: weights contiguous bfloat16 [N, K]");
  TORCH_CHECK(w.size(0) % 16 == 0 && w.size(1) % 32 == 0, "LlamaDecoder: weight rows % 16, columns % 32");
  Linear L;
  L.weight = w;
  L.N = w.size(0);
  L.K = w.size(1);
  if (bias.defined() && bias.numel()) L.bias = bias.to(at::kFloat).contiguous();
  return L;
}

}  // namespace

class LlamaDecoder {
 public:
  // layers: per layer [input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias,
  // k_cache, v_cache]; an absent bias is an empty tensor. qkv rows: q heads, then k heads, then v heads.
  LlamaDecoder(const torch::Tensor& embed, const std::vector<std::vector<torch::Tensor>>& layers,
               const torch::Tensor& final_norm, const torch::Tensor& head, const torch::Tensor& head_bias,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, int64_t block_size, double scale, bool amx)
      : embed_(embed), final_norm_(final_norm), heads_(heads), kv_heads_(kv_heads), dim_(head_dim), eps_(eps),
        block_size_(block_size), scale_(scale), amx_(amx) {
    TORCH_CHECK(!amx || amx_available(), "LlamaDecoder: AMX is not available");
    TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 512 && heads % kv_heads == 0, "LlamaDecoder: head_dim % 32, GQA");
    head_ = make_linear(head, head_bias);
    hidden_ = head_.K;
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 12, "LlamaDecoder: 12 tensors per layer");
      DecoderLayer l;
      l.input_norm = t[0];
      l.qkv = make_linear(t[1], t[2]);
      l.o = make_linear(t[3], t[4]);
      l.post_norm = t[5];
      l.gate_up = make_linear(t[6], t[7]);
      l.down = make_linear(t[8], t[9]);
      l.k_cache = t[10];
      l.v_cache = t[11];
      TORCH_CHECK(l.qkv.N == (heads + 2 * kv_heads) * head_dim && l.qkv.K == hidden_ && l.o.N == hidden_ &&
                  l.o.K == heads * head_dim && l.gate_up.K == hidden_ && l.down.N == hidden_ &&
                  l.gate_up.N == 2 * l.down.K && l.down.K % 16 == 0, "LlamaDecoder: inconsistent shapes");
      for (const auto* n : {&l.input_norm, &l.post_norm})
        TORCH_CHECK(n->scalar_type() == at::kBFloat16 && n->is_contiguous() && n->numel() == hidden_,
                    "LlamaDecoder: norm weights bfloat16 [hidden]");
      for (const auto* c : {&l.k_cache, &l.v_cache})
        TORCH_CHECK(c->scalar_type() == at::kBFloat16 && c->is_contiguous() && c->dim() == 3 &&
                    c->size(1) == kv_heads && c->size(2) == head_dim, "LlamaDecoder: bfloat16 caches [slots, KVH, D]");
      layers_.push_back(std::move(l));
    }
    TORCH_CHECK(final_norm.scalar_type() == at::kBFloat16 && final_norm.numel() == hidden_, "LlamaDecoder: final norm");
    TORCH_CHECK(embed.scalar_type() == at::kBFloat16 && embed.is_contiguous() && embed.dim() == 2 &&
                embed.size(1) == hidden_, "LlamaDecoder: embeddings bfloat16 [vocab, hidden]");
    if (amx_) pack_all();
  }

  // ids [B] (this step's tokens), rope_rows [B] (each token's row of the RoPE tables cos and sin [rows, head_dim]),
  // slots [B], block_tables [B, max_blocks], lengths [B] (context tokens, this one included). Returns float32 logits
  // [B, vocab] holding the bfloat16 values the LM head rounds to. Embedding lookup to logits is one call, so no
  // torch op runs between steps on caches the weight stream has just flushed.
  torch::Tensor step(const torch::Tensor& ids, const torch::Tensor& rope_rows, const torch::Tensor& cos,
                     const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& block_tables,
                     const torch::Tensor& lengths) {
    auto tok = ids.to(at::kLong).contiguous(), rope = rope_rows.to(at::kLong).contiguous();
    auto cs = cos.to(at::kBFloat16).contiguous(), sn = sin.to(at::kBFloat16).contiguous();
    auto slot = slots.to(at::kLong).contiguous(), tables = block_tables.to(at::kLong).contiguous();
    auto lens = lengths.to(at::kLong).contiguous();
    const int64_t B = tok.numel(), H = heads_, KVH = kv_heads_, D = dim_, hid = hidden_;
    TORCH_CHECK(rope.numel() == B && slot.numel() == B && tables.size(0) == B && lens.numel() == B,
                "LlamaDecoder.step: one RoPE row, slot, table and length per token");
    TORCH_CHECK(cs.dim() == 2 && cs.size(1) == D && sn.sizes() == cs.sizes(), "LlamaDecoder.step: cos, sin [rows, head_dim]");
    const int64_t *tokp = tok.data_ptr<int64_t>(), *ropep = rope.data_ptr<int64_t>();
    for (int64_t m = 0; m < B; ++m)
      TORCH_CHECK(tokp[m] >= 0 && tokp[m] < embed_.size(0) && ropep[m] >= 0 && ropep[m] < cs.size(0),
                  "LlamaDecoder.step: token id or RoPE row out of range");
    const int64_t QKV = (H + 2 * KVH) * D, I = layers_.empty() ? 0 : layers_[0].down.K, V = head_.N;
    auto opts = embed_.options();
    auto h = torch::empty({B, hid}, opts);  // the residual stream, from the embeddings
    for (int64_t m = 0; m < B; ++m)
      std::copy_n(embed_.data_ptr<bf16>() + tokp[m] * hid, hid, h.data_ptr<bf16>() + m * hid);
    auto x = torch::empty({B, hid}, opts), delta = torch::empty({B, hid}, opts), qkv = torch::empty({B, QKV}, opts);
    auto q = torch::empty({B, H, D}, opts), attn = torch::empty({B, H * D}, opts);
    auto gu = torch::empty({B, 2 * I}, opts), act = torch::empty({B, I}, opts), head_out = torch::empty({B, V}, opts);
    auto logits = torch::empty({B, V}, opts.dtype(at::kFloat));
    bf16 *hp = h.data_ptr<bf16>(), *xp = x.data_ptr<bf16>(), *dp = delta.data_ptr<bf16>(),
         *qkvp = qkv.data_ptr<bf16>(), *qp = q.data_ptr<bf16>(), *ap = attn.data_ptr<bf16>(),
         *gup = gu.data_ptr<bf16>(), *actp = act.data_ptr<bf16>(), *lp = head_out.data_ptr<bf16>();
    float* logitsp = logits.data_ptr<float>();
    const bf16 *cs0 = cs.data_ptr<bf16>(), *sn0 = sn.data_ptr<bf16>();
    const int64_t *slotp = slot.data_ptr<int64_t>(), *tp = tables.data_ptr<int64_t>(), *lenp = lens.data_ptr<int64_t>();
    const int64_t max_blocks = tables.size(1);
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
    const std::vector<AttnItem> items = attn_items(lenp, B, KVH);
    AttnPartials partials;
    partials.reset(lenp, B, H, D);
    SpinBarrier barrier;
#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp single
      barrier.n = omp_get_num_threads();
      const int T = barrier.n, t = omp_get_thread_num();
      Scratch s;
      auto rows = [&](const torch::Tensor& w, const bf16* add) {  // h += add; x = RMSNorm(h) * w, rows shared
        for (int64_t m = t; m < B; m += T)
          add_rms_norm_row(hp + m * hid, add ? add + m * hid : nullptr, w.data_ptr<bf16>(), xp + m * hid, hid, eps);
        barrier.wait();
      };
      auto columns = [&](const Linear& L) {  // this thread's output columns (AMX: whole packed blocks)
        auto [n0, n1] = share(L.N, amx_ ? 32 : 16, t, T);
        return std::make_pair(n0, t == T - 1 ? L.N : n1);
      };
      auto matmul = [&](const Linear& L, const bf16* in, bf16* out) {
        const auto [n0, n1] = columns(L);
        linear_rows(L, in, L.K, B, out, L.N, n0, n1, amx_, s);
        barrier.wait();
      };
      for (size_t li = 0; li < layers_.size(); ++li) {
        const DecoderLayer& l = layers_[li];
        rows(l.input_norm, li ? dp : nullptr);
        auto* kc = l.k_cache.data_ptr<bf16>();
        auto* vc = l.v_cache.data_ptr<bf16>();
        matmul(l.qkv, xp, qkvp);
        for (int64_t i = t; i < B * (H + 2 * KVH); i += T) {  // RoPE on q and k; k and v into their cache slots
          const int64_t m = i / (H + 2 * KVH), head = i % (H + 2 * KVH);
          const bf16* src = qkvp + m * QKV + head * D;
          const bf16 *cp = cs0 + ropep[m] * D, *sp = sn0 + ropep[m] * D;
          if (head < H) rope_head(src, cp, sp, qp + (m * H + head) * D, D);
          else if (head < H + KVH) rope_head(src, cp, sp, kc + (slotp[m] * KVH + head - H) * D, D);
          else std::copy(src, src + D, vc + (slotp[m] * KVH + head - H - KVH) * D);
        }
        barrier.wait();
        for (size_t i = t; i < items.size(); i += T)
          attend_chunk(items[i], qp, kc, vc, tp, lenp, H, KVH, D, max_blocks, block_size_, scale, partials, s.attn);
        barrier.wait();
        for (int64_t i = t; i < B * H; i += T) merge_chunks(i / H, i % H, lenp, ap, H, D, partials);
        barrier.wait();
        matmul(l.o, ap, dp);
        rows(l.post_norm, dp);
        matmul(l.gate_up, xp, gup);
        const auto [e0, e1] = share(B * I, 16, t, T);
        for (int64_t e = e0; e < e1; e += 16) {
          const int64_t m = e / I, j = e % I;
          silu_mul16(gup + m * 2 * I + j, gup + m * 2 * I + I + j, actp + e);
        }
        barrier.wait();
        matmul(l.down, actp, dp);
      }
      rows(final_norm_, layers_.empty() ? nullptr : dp);
      const auto [v0, v1] = columns(head_);  // the LM head, then this thread's logits as float32
      linear_rows(head_, xp, head_.K, B, lp, V, v0, v1, amx_, s);
      for (int64_t m = 0; m < B; ++m)
        for (int64_t n = v0; n < v1; n += 16)
          _mm512_storeu_ps(logitsp + m * V + n, load16(lp + m * V + n));
      if (amx_) _tile_release();
    }
    return logits;
  }

 private:
  // A copy of every matmul's weights in the AMX layout, in the order a step reads them.
  void pack_all() {
    std::vector<Linear*> all;
    for (auto& l : layers_)
      for (Linear* L : {&l.qkv, &l.o, &l.gate_up, &l.down}) all.push_back(L);
    all.push_back(&head_);
    int64_t elements = 0;
    for (const Linear* L : all) elements += L->N * L->K;
    packed_ = std::make_unique<PackedBuffer>(elements);
    uint16_t* at = packed_->data;
    for (Linear* L : all) {
      pack_weight(reinterpret_cast<const uint16_t*>(L->weight.data_ptr()), L->N, L->K, at);
      L->packed = at;
      at += L->N * L->K;
    }
  }

  std::unique_ptr<PackedBuffer> packed_;
  torch::Tensor embed_;
  std::vector<DecoderLayer> layers_;
  torch::Tensor final_norm_;
  Linear head_;
  int64_t heads_, kv_heads_, dim_, hidden_ = 0;
  double eps_;
  int64_t block_size_;
  double scale_;
  bool amx_;
};

// Each row's index of its largest value, as torch.argmax gives it: the first such index, and a NaN counts as
// the largest. One thread: at 1-16 rows of a 50k vocabulary it is tens of microseconds, where torch's scalar
// reduction takes 0.25 ms a row (a greedy step's sampling).
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: float32 [rows, n > 0], contiguous");
  const int64_t R = x.size(0), N = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * N;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= N; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_max_ps(best, v);
    }
    float m = _mm512_reduce_max_ps(best);
    bool has_nan = nan != 0;
    for (; i < N; ++i) {
      has_nan |= std::isnan(row[i]);
      m = std::max(m, row[i]);
    }
    int64_t at = 0;
    if (has_nan) {
      while (!std::isnan(row[at])) ++at;
    } else {
      const __m512 target = _mm512_set1_ps(m);
      int64_t j = 0;
      for (; j + 16 <= N; j += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), target, _CMP_EQ_OQ);
        if (hit) break;
      }
      while (row[j] != m) ++j;  // within the 16 that hit, or the tail
      at = j;
    }
    o[r] = at;
  }
  return out;
}

// Sum of a float32 buffer with AVX-512 loads on all threads: scripts/bandwidth.py's hand-written read, the
// access pattern of a decode step's weight stream without its arithmetic.
double stream_read(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() % 64 == 0, "stream_read: float32, % 64");
  const float* p = t.data_ptr<float>();
  std::vector<double> partial(at::get_num_threads() + 1, 0.0);
  at::parallel_for(0, t.numel() / 64, 4096, [&](int64_t begin, int64_t end) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = begin; i < end; ++i) {
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i * 64));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i * 64 + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i * 64 + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i * 64 + 48));
    }
    partial[at::get_thread_num()] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs, as torch's own ops do, so the server's event loop keeps going.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("add_rms_norm_", &add_rms_norm_, "h += delta; RMSNorm(h), Llama rounding", release());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache", release());
  m.def("linear_bf16", &linear_bf16, "bf16 x[M, K] @ w[N, K]^T (+ bias), AVX512-BF16", release());
  m.def("amx_available", &amx_available, "this CPU has AMX-BF16 and Linux lets the process use it");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (NaN largest)", release());
  m.def("stream_read", &stream_read, "sum of a float32 buffer, AVX-512 reads on all threads", release());
  py::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(py::init<const torch::Tensor&, const std::vector<std::vector<torch::Tensor>>&, const torch::Tensor&,
                    const torch::Tensor&, const torch::Tensor&, int64_t, int64_t, int64_t, double, int64_t, double,
                    bool>())
      .def("step", &LlamaDecoder::step,
           "one decode step: step(ids, rope_rows, cos, sin, slots, block_tables, lengths) -> float32 logits [B, vocab]",
           release());
}
