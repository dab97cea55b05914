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

#include <algorithm>
#include <cmath>
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

template <int M>
void gemv(const uint16_t* x, const uint16_t* w, const float* bias, c10::BFloat16* out, int64_t K, int64_t N,
          int64_t ldx, int64_t ldo) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);  // accumulators M * R + loads stay within 32 registers
  const int64_t blocks = N / R;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rows_block<M, R>(x, w, bias, out, K, ldo, b * R, ldx);
  });
  for (int64_t n = blocks * R; n < N; ++n) rows_block<M, 1>(x, w, bias, out, K, ldo, n, ldx);
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
    const uint16_t* xm = xp + m0 * ldx;
    c10::BFloat16* om = op + m0 * N;
    switch (std::min<int64_t>(M - m0, 8)) {
      case 1: gemv<1>(xm, wp, bp, om, K, N, ldx, N); break;
      case 2: gemv<2>(xm, wp, bp, om, K, N, ldx, N); break;
      case 3: gemv<3>(xm, wp, bp, om, K, N, ldx, N); break;
      case 4: gemv<4>(xm, wp, bp, om, K, N, ldx, N); break;
      case 5: gemv<5>(xm, wp, bp, om, K, N, ldx, N); break;
      case 6: gemv<6>(xm, wp, bp, om, K, N, ldx, N); break;
      case 7: gemv<7>(xm, wp, bp, om, K, N, ldx, N); break;
      default: gemv<8>(xm, wp, bp, om, K, N, ldx, N); break;
    }
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
inline __m512 exp_nonpositive(__m512 x) {
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

// One work item is one sequence and one KV head: the K and V rows are read once for the whole GQA group of
// query heads that share them. Scores for all context tokens first, then softmax, then the weighted sum of V.
template <typename T>
void paged_decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                  const int64_t* lengths, T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                  int64_t max_blocks, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t chunks = dim / 16;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<__m512> qv(group * chunks), acc(group * chunks);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, kvh = i % kv_heads, len = lengths[b], h0 = kvh * group;
      const int64_t* table = block_tables + b * max_blocks;
      const int64_t padded = (len + 15) / 16 * 16;
      scores.assign(group * padded, -INFINITY);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < chunks; ++c)
          qv[g * chunks + c] = _mm512_mul_ps(load16(q + ((b * heads + h0 + g) * dim) + c * 16), _mm512_set1_ps(scale));
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, len - t0);
        for (int64_t o = 0; o < n; ++o) {
          const T* kp = k_cache + ((base + o) * kv_heads + kvh) * dim;
          for (int64_t g = 0; g < group; ++g) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; ++c) dot = _mm512_fmadd_ps(qv[g * chunks + c], load16(kp + c * 16), dot);
            scores[g * padded + t0 + o] = _mm512_reduce_add_ps(dot);
          }
        }
      }
      std::vector<__m512> inv_total(group);
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * padded;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < padded; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < padded; t += 16) {  // the -inf padding becomes 0
          const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + t), m));
          _mm512_storeu_ps(row + t, e);
          total = _mm512_add_ps(total, e);
        }
        inv_total[g] = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
      }
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, len - t0);
        for (int64_t o = 0; o < n; ++o) {
          const T* vp = v_cache + ((base + o) * kv_heads + kvh) * dim;
          for (int64_t c = 0; c < chunks; ++c) {
            const __m512 v = load16(vp + c * 16);
            for (int64_t g = 0; g < group; ++g)
              acc[g * chunks + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * padded + t0 + o]), v, acc[g * chunks + c]);
          }
        }
      }
      alignas(64) float row[16];
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out + (b * heads + h0 + g) * dim;
        for (int64_t c = 0; c < chunks; ++c) {
          _mm512_store_ps(row, _mm512_mul_ps(acc[g * chunks + c], inv_total[g]));
          for (int j = 0; j < 16; ++j) dst[c * 16 + j] = static_cast<T>(row[j]);
        }
      }
    }
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
  TORCH_CHECK(D % 16 == 0 && k_cache.size(2) == D && H % KVH == 0, "paged_decode_attention: head dim % 16, GQA");
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
void add_rms_norm(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * hidden;
      float sumsq = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        if (delta) hr[i] = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(delta[r * hidden + i]));
        const float v = static_cast<float>(hr[i]);
        sumsq += v * v;
      }
      const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) {
        const T normed = static_cast<T>(static_cast<float>(hr[i]) * inv);  // rounded to the model dtype, then
        out[r * hidden + i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));  // scaled
      }
    }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs, as torch's own ops do, so the server's event loop keeps going.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("add_rms_norm_", &add_rms_norm_, "h += delta; RMSNorm(h), Llama rounding", release());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache", release());
  m.def("linear_bf16", &linear_bf16, "bf16 x[M, K] @ w[N, K]^T (+ bias), AVX512-BF16", release());
}
