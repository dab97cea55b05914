// Decode attention straight from the paged KV cache, in fixed chunks of context positions.
#include "attention.h"

namespace peregrine {
namespace {

constexpr int kPos = 16;  // context positions whose dot products are summed together

// out[o] = the horizontal sum of v[o], for the kPos vectors of a batch of positions.
__attribute__((always_inline)) inline void sums16(const Vec* v, float* out) {
#if defined(__AVX512F__)
  // The 16 sums as one vector: a transpose by shuffles instead of 16 reductions.
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] and v[2i+1] folded to pairs
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int j = 0; j < 4; ++j)  // per lane: the lane's sums of v[4j..4j+3]
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1))));
#elif defined(__AVX2__) && defined(__FMA__)
  // Each 8 sums as one vector, by shuffles, adding in Vec::sum()'s association (so decode and prefill rows, and
  // every build of this level, give the same bits): per vector lo + hi halves, then lanes (0 + 2, 1 + 3), then
  // (0 + 2) + (1 + 3). Vectors o and o + 4 share a pair in the first step, so the sums land in position order.
  for (int h = 0; h < kPos; h += 8) {
    __m256 x[4], t[2];
    for (int i = 0; i < 4; ++i) {
      const __m256 a = v[h + i].v, b = v[h + i + 4].v;
      x[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (int j = 0; j < 2; ++j)
      t[j] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_storeu_ps(out + h, _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                            _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1))));
  }
#else
  for (int o = 0; o < kPos; ++o) out[o] = v[o].sum();
#endif
}

// The softmax numerators exp(score - max) of each head's chunk scores, in place; the max and their sum go to the
// head's partial.
__attribute__((always_inline)) inline void chunk_softmax(float* scores, float* part, int64_t dim) {
  Vec vmax = Vec::set1(-INFINITY);
  for (int64_t o = 0; o < kAttnChunk; o += Vec::W) vmax = max(vmax, Vec::load(scores + o));
  const float top = vmax.max();
  Vec total = Vec::zero();
  for (int64_t o = 0; o < kAttnChunk; o += Vec::W) {  // the -inf padding becomes 0
    const Vec e = exp_nonpositive(Vec::load(scores + o) - Vec::set1(top));
    e.store(scores + o);
    total = total + e;
  }
  part[dim] = top;
  part[dim + 1] = total.sum();
}

// The chunk's scores of one head against n <= kAttnChunk key rows (-inf past n), kPos positions at a time.
// qv: the head's scaled query, CH vectors (CH known at compile time, or 0: `chunks` at run time). Each position's
// dot product is one chain of FMAs over the head's vectors in order; kChains positions' chains run side by side
// (one chain alone waits on each FMA's latency), which changes no position's arithmetic.
constexpr int kChains = Vec::W == 16 ? 4 : 8;
// An int8 cache's rows carry a scale each (attend_chunk): a position's dot product with the widened int8 values is
// taken times its K scale, and its softmax weight times its V scale. Widened values are exact floats, so the rows
// read as int8 or from attend_chunk's widened copy give the same bits.
template <typename C>
constexpr bool kScaled = std::is_same_v<C, int8_t>;
// cap > 0: each score soft-capped (soft_cap) before the softmax. ksc: the positions' K scales (an int8 cache, n
// rounded up to kPos of them), or null.
template <int CH, typename C>
__attribute__((always_inline)) inline void head_scores(const Vec* qv, int64_t chunks, const C* const* k_rows,
                                                       int64_t n, float* scores, float cap, const float* ksc) {
  const int64_t count = CH ? CH : chunks;
  for (int64_t o0 = 0; o0 < n; o0 += kPos) {
    const int64_t m = std::min<int64_t>(kPos, n - o0);
    Vec dots[kPos];
    for (int o = 0; o < kPos; o += kChains) {
      const C* r[kChains];
      Vec dot[kChains];
      for (int j = 0; j < kChains; ++j) {
        r[j] = k_rows[o0 + std::min<int64_t>(o + j, m - 1)];  // past the end: the last row again, dropped below
        dot[j] = Vec::zero();
      }
      for (int64_t c = 0; c < count; ++c) {
        const Vec qc = qv[c];
        for (int j = 0; j < kChains; ++j) dot[j] = fmadd(qc, Vec::load(r[j] + c * Vec::W), dot[j]);
      }
      for (int j = 0; j < kChains; ++j) dots[o + j] = dot[j];
    }
    alignas(64) float sums[kPos];
    sums16(dots, sums);
    if (ksc)
      for (int o = 0; o < kPos; o += Vec::W) (Vec::load(sums + o) * Vec::load(ksc + o0 + o)).store(sums + o);
    if (cap > 0.f)
      for (int o = 0; o < kPos; o += Vec::W) soft_cap(Vec::load(sums + o), cap).store(sums + o);
    std::copy_n(sums, m, scores + o0);
  }
}

// One chunk for GP query heads of a GQA group (from g0), head_dim D known at compile time: the query vectors and
// the V accumulators stay in registers (as far as there are registers). The arithmetic and its order are
// attend_generic's, so both give the same bits.
template <int D, int GP, typename T, typename C>
void attend_heads(int64_t b, int64_t h0, int64_t chunk, const T* q, const C* const* k_rows, const C* const* v_rows,
                  int64_t n, int64_t heads, float scale, float cap, const float* ksc, const float* vsc,
                  AttnPartials& partials) {
  constexpr int CH = D / Vec::W;
  Vec qv[GP][CH];
  for (int g = 0; g < GP; ++g)
    for (int c = 0; c < CH; ++c)
      qv[g][c] = Vec::load(q + (b * heads + h0 + g) * D + c * Vec::W) * Vec::set1(scale);
  alignas(64) float scores[GP][kAttnChunk];
  for (int g = 0; g < GP; ++g) {
    std::fill_n(scores[g], kAttnChunk, -INFINITY);
    head_scores<CH>(qv[g], CH, k_rows, n, scores[g], cap, ksc);
  }
  for (int g = 0; g < GP; ++g) chunk_softmax(scores[g], partials.at(b, h0 + g, chunk), D);
  Vec acc[GP][CH];
  for (int g = 0; g < GP; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = Vec::zero();
  for (int64_t o = 0; o < n; ++o) {
    const C* vp = v_rows[o];
    float w[GP];
    for (int g = 0; g < GP; ++g) w[g] = vsc ? scores[g][o] * vsc[o] : scores[g][o];
    for (int c = 0; c < CH; ++c) {
      const Vec v = Vec::load(vp + c * Vec::W);
      for (int g = 0; g < GP; ++g) acc[g][c] = fmadd(Vec::set1(w[g]), v, acc[g][c]);
    }
  }
  for (int g = 0; g < GP; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c].store(partials.at(b, h0 + g, chunk) + c * Vec::W);
}

// attend_heads for `count` (1..GP) heads: the instantiation with that many.
template <int D, int GP, typename T, typename C>
void attend_pass(int64_t count, int64_t b, int64_t h0, int64_t chunk, const T* q, const C* const* k_rows,
                 const C* const* v_rows, int64_t n, int64_t heads, float scale, float cap, const float* ksc,
                 const float* vsc, AttnPartials& partials) {
  if (count == GP) attend_heads<D, GP, T, C>(b, h0, chunk, q, k_rows, v_rows, n, heads, scale, cap, ksc, vsc, partials);
  else if constexpr (GP > 1)
    attend_pass<D, GP - 1, T, C>(count, b, h0, chunk, q, k_rows, v_rows, n, heads, scale, cap, ksc, vsc, partials);
}

// Any head_dim (a multiple of 16): the same arithmetic as attend_heads, with the sizes known only at run time.
template <typename T, typename C>
void attend_generic(int64_t b, int64_t h0, int64_t group, int64_t chunk, const T* q, const C* const* k_rows,
                    const C* const* v_rows, int64_t n, int64_t heads, int64_t dim, float scale, float cap,
                    const float* ksc, const float* vsc, AttnPartials& partials, AttnScratch& s) {
  const int64_t chunks = dim / Vec::W;
  s.scores.assign(group * kAttnChunk, -INFINITY);
  s.qv.resize(group * chunks);
  s.acc.assign(group * chunks, Vec::zero());
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      s.qv[g * chunks + c] = Vec::load(q + ((b * heads + h0 + g) * dim) + c * Vec::W) * Vec::set1(scale);
  for (int64_t g = 0; g < group; ++g)
    head_scores<0>(s.qv.data() + g * chunks, chunks, k_rows, n, s.scores.data() + g * kAttnChunk, cap, ksc);
  for (int64_t g = 0; g < group; ++g) chunk_softmax(s.scores.data() + g * kAttnChunk, partials.at(b, h0 + g, chunk), dim);
  for (int64_t o = 0; o < n; ++o) {
    const C* vp = v_rows[o];
    for (int64_t c = 0; c < chunks; ++c) {
      const Vec v = Vec::load(vp + c * Vec::W);
      for (int64_t g = 0; g < group; ++g) {
        const float w = s.scores[g * kAttnChunk + o];
        s.acc[g * chunks + c] = fmadd(Vec::set1(vsc ? w * vsc[o] : w), v, s.acc[g * chunks + c]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c) s.acc[g * chunks + c].store(partials.at(b, h0 + g, chunk) + c * Vec::W);
}

// Query heads per register-resident pass: what fits in about half the vector registers.
constexpr int kRegFloats = Vec::W == 16 ? 256 : 64;
template <int D>
constexpr int kHeadsPerPass = kRegFloats / D > 1 ? kRegFloats / D : 1;

}  // namespace

// Per query head of the item's GQA group: the chunk's scores (kPos positions at a time), softmax numerators,
// weighted V sum. Head dims of 32, 64 and 128 take the register-resident attend_heads, a few heads at a time;
// others the generic loop.
template <typename T, typename C>
void attend_chunk(const AttnItem& item, const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                  const int64_t* lengths, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_blocks,
                  int64_t block_size, float scale, AttnPartials& partials, AttnScratch& s, int64_t window,
                  float cap, const float* k_scales, const float* v_scales) {
  const int64_t kvh = item.kvh, last = item.b_end - 1;  // the item's rows share the last row's table
  const int64_t h0 = kvh * (heads / kv_heads) + item.g0, group = item.g1 - item.g0;  // this item's query heads
  const int64_t* table = block_tables + last * max_blocks;
  const int64_t chunk_begin = item.chunk * kAttnChunk;
  const int64_t first_pos = window > 0 ? std::max(chunk_begin, lengths[item.b] - window) : chunk_begin;
  // the rows' positions in all; none where the chunk lies behind the first row's window (the later rows' too)
  const int64_t span = std::max<int64_t>(std::min(chunk_begin + kAttnChunk, lengths[last]) - first_pos, 0);
  const C* k_rows[kAttnChunk];
  const C* v_rows[kAttnChunk];
  alignas(64) float k_sc[kAttnChunk + kPos], v_sc[kAttnChunk + kPos];  // an int8 cache's row scales (zero past span)
  for (int64_t o = 0, block = first_pos / block_size, slot = first_pos % block_size; o < span; ++o) {
    const int64_t row = (table[block] * block_size + slot) * kv_heads + kvh;  // no division per row
    k_rows[o] = k_cache + row * dim;
    v_rows[o] = v_cache + row * dim;
    if constexpr (kScaled<C>) k_sc[o] = k_scales[row], v_sc[o] = v_scales[row];
    if (++slot == block_size) slot = 0, ++block;
  }
  if constexpr (kScaled<C>) {  // past the rows: scales of 0, read (by whole vectors) and dropped
    std::fill(k_sc + span, k_sc + kAttnChunk + kPos, 0.f);
    std::fill(v_sc + span, v_sc + kAttnChunk + kPos, 0.f);
  }
  // The rows come from memory (a step's weight stream evicts them): ask for all of the chunk's rows up front, into
  // L2. Into L1 (prefetcht0; 512 lines, a float16 chunk at head_dim 128, are the whole L1) the loop still waited on
  // the V rows' lines, and a step's attention ran 1.2x slower (AMD EPYC Zen 4, docs/benchmarks.md "Decode
  // attention's rows from memory").
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(C));
  for (int64_t o = 0; o < span; ++o)
    for (int64_t l = 0; l < row_bytes; l += 64) {
      prefetch_l2(reinterpret_cast<const char*>(k_rows[o]) + l);
      prefetch_l2(reinterpret_cast<const char*>(v_rows[o]) + l);
    }
  // The item's rows, over key and value rows of element E (C, or float: an int8 cache's rows widened once).
  auto attend_rows = [&](const auto* const* k_in, const auto* const* v_in) {
    using E = std::remove_cv_t<std::remove_pointer_t<std::remove_cv_t<std::remove_pointer_t<decltype(k_in)>>>>;
    for (int64_t b = item.b; b < item.b_end; ++b) {
      const int64_t chunk_end = std::min(chunk_begin + kAttnChunk, lengths[b]);
      const int64_t p_begin = window > 0 ? std::max(chunk_begin, lengths[b] - window) : chunk_begin;
      const int64_t n = chunk_end - p_begin;
      if (n <= 0) {  // wholly outside the window: weight 0 in the merge
        for (int64_t g = 0; g < group; ++g) {
          float* part = partials.at(b, h0 + g, item.chunk);
          std::fill(part, part + dim, 0.f);
          part[dim] = -INFINITY;
          part[dim + 1] = 0.f;
        }
        continue;
      }
      const E* const* kr = k_in + (p_begin - first_pos);
      const E* const* vr = v_in + (p_begin - first_pos);
      const float* ksc = kScaled<C> ? k_sc + (p_begin - first_pos) : nullptr;
      const float* vsc = kScaled<C> ? v_sc + (p_begin - first_pos) : nullptr;
      auto passes = [&](auto d) {
        constexpr int D = decltype(d)::value, GP = kHeadsPerPass<D>;
        for (int64_t g0 = 0; g0 < group; g0 += GP)
          attend_pass<D, GP, T, E>(std::min<int64_t>(GP, group - g0), b, h0 + g0, item.chunk, q, kr, vr, n, heads,
                                   scale, cap, ksc, vsc, partials);
      };
      if (dim == 32) passes(std::integral_constant<int, 32>{});
      else if (dim == 64) passes(std::integral_constant<int, 64>{});
      else if (dim == 128) passes(std::integral_constant<int, 128>{});
      else attend_generic(b, h0, group, item.chunk, q, kr, vr, n, heads, dim, scale, cap, ksc, vsc, partials, s);
    }
  };
  if constexpr (kScaled<C>) {
    if (item.b_end - item.b > 1) {  // rows of a prompt share the chunk: its rows widened once, not once per row
      s.kf.resize(span * dim);
      s.vf.resize(span * dim);
      const float* kf[kAttnChunk];
      const float* vf[kAttnChunk];
      for (int64_t o = 0; o < span; ++o) {
        float *kd = s.kf.data() + o * dim, *vd = s.vf.data() + o * dim;
        for (int64_t c = 0; c < dim; c += Vec::W) {
          Vec::load(k_rows[o] + c).store(kd + c);
          Vec::load(v_rows[o] + c).store(vd + c);
        }
        kf[o] = kd, vf[o] = vd;
      }
      attend_rows(kf, vf);
      return;
    }
  }
  attend_rows(k_rows, v_rows);
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
    for (int64_t d = 0; d < dim; d += Vec::W) fmadd(Vec::set1(w), Vec::load(part + d), Vec::load(acc + d)).store(acc + d);
  }
  T* dst = out + (b * heads + h) * dim;
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] / total);
}

#define PEREGRINE_ATTEND_CHUNK(T, C)                                                                          \
  template void attend_chunk<T, C>(const AttnItem&, const T*, const C*, const C*, const int64_t*, const int64_t*,  \
                                   int64_t, int64_t, int64_t, int64_t, int64_t, float, AttnPartials&, AttnScratch&, \
                                   int64_t, float, const float*, const float*);
PEREGRINE_ATTEND_CHUNK(float, float)
PEREGRINE_ATTEND_CHUNK(bf16, bf16)
PEREGRINE_ATTEND_CHUNK(float, f16)
PEREGRINE_ATTEND_CHUNK(bf16, f16)
PEREGRINE_ATTEND_CHUNK(float, int8_t)
PEREGRINE_ATTEND_CHUNK(bf16, int8_t)
#undef PEREGRINE_ATTEND_CHUNK
template void merge_chunks<float>(int64_t, int64_t, const int64_t*, float*, int64_t, int64_t, AttnPartials&);
template void merge_chunks<bf16>(int64_t, int64_t, const int64_t*, bf16*, int64_t, int64_t, AttnPartials&);

namespace {

template <typename T, typename C>
void paged_decode(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                  const int64_t* lengths, T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                  int64_t max_blocks, int64_t block_size, float scale, float cap) {
  const std::vector<AttnItem> items = attn_items(lengths, batch, kv_heads, heads / kv_heads, block_tables, max_blocks);
  AttnPartials partials;
  partials.reset(lengths, batch, heads, dim);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    AttnScratch s;
    for (int64_t i = begin; i < end; ++i)
      attend_chunk(items[i], q, k_cache, v_cache, block_tables, lengths, heads, kv_heads, dim, max_blocks, block_size,
                   scale, partials, s, 0, cap);
  });
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) merge_chunks(i / heads, i % heads, lengths, out, heads, dim, partials);
  });
}

}  // namespace

// Decode attention straight from the paged cache: one query token per sequence, no gather, no padding.
// q [B, H, D]; k_cache, v_cache [slots, KVH, D] in q's dtype or float16 (a cache kept in half the bytes);
// block_tables [B, max_blocks] long; lengths [B] long (tokens of context, this step's included). Softmax in float32,
// over scores soft-capped when `softcap` > 0 (Gemma 2: softcap * tanh(score / softcap)). Returns [B, H, D] in q's
// dtype.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& lengths, int64_t block_size, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_decode_attention: contiguous q [B, H, D], caches [slots, KVH, D]");
  const at::ScalarType qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK((qt == at::kFloat || qt == at::kBFloat16) && (ct == qt || ct == at::kHalf) && v_cache.scalar_type() == ct,
              "paged_decode_attention: q in float32 or bfloat16, both caches in q's dtype or float16");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 512 && k_cache.size(2) == D && H % KVH == 0,
              "paged_decode_attention: head dim % 16 and <= 512, GQA");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B, "paged_decode_attention: one table and length per row");
  auto out = torch::empty_like(q);
  TORCH_CHECK(softcap >= 0.0, "paged_decode_attention: softcap is positive, or 0 for none");
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  auto run = [&](auto q_elem, auto cache_elem) {  // the element types, as values
    using T = decltype(q_elem);
    using C = decltype(cache_elem);
    paged_decode(q.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), tables.data_ptr<int64_t>(),
                 lens.data_ptr<int64_t>(), out.data_ptr<T>(), B, H, KVH, D, tables.size(1), block_size, s, cap);
  };
  if (qt == at::kFloat) ct == at::kHalf ? run(float{}, f16{}) : run(float{}, float{});
  else ct == at::kHalf ? run(bf16{}, f16{}) : run(bf16{}, bf16{});
  return out;
}

}  // namespace peregrine
