// linear_small: small-batch linear, out[M, N] = x[M, K] @ w[N, K]^T (+ bias), float32 or bfloat16.
// Decoding a few rows at a time is a matrix-vector product: every weight is read once per step and used M times,
// so the step is bound by memory bandwidth. Each weight row is streamed once, R rows at a time, for up to 8 inputs
// per pass (more in passes of 8 over chunks of weight rows that stay in L2), accumulating in float32: bf16 pairs
// through `vdpbf16ps` where the build has AVX512-BF16, else each vector of weights widened to float32 in registers
// and multiplied by FMA. Each output element is computed by the same instructions in the same order whatever M is,
// so a sequence's logits do not depend on its batch mates.
#include "kernels.h"

namespace peregrine {
namespace {

template <typename T>
inline void put(T* out, int64_t at, float v) { out[at] = static_cast<T>(v); }

// Output rows n0 .. n0 + R for M input rows: M * R float32 accumulators, one weight vector per row in flight.
template <int M, int R, typename T>
void rows_block(const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldo, int64_t n0, int64_t ldx) {
  Vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = Vec::zero();
  for (int64_t k = 0; k < K; k += Vec::W) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Vec::load(w + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const Vec xv = Vec::load(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = fmadd(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) put(out, m * ldo + n0 + r, acc[m][r].sum() + (bias ? bias[n0 + r] : 0.f));
}

#if defined(__AVX512BF16__)
// bf16 on AVX512-BF16: 32 bf16 pairs per instruction, multiplied and accumulated in float32.
template <int M, int R>
void rows_block_dp(const bf16* x, const bf16* w, const float* bias, bf16* out, int64_t K, int64_t ldo, int64_t n0,
                   int64_t ldx) {
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
      out[m * ldo + n0 + r] = bf16(v);
    }
}
#endif

template <int M, int R, typename T>
inline void block(const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldo, int64_t n, int64_t ldx) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) return rows_block_dp<M, R>(x, w, bias, out, K, ldo, n, ldx);
#endif
  rows_block<M, R>(x, w, bias, out, K, ldo, n, ldx);
}

// Output columns [n_begin, n_end) for M <= 8 input rows, R weight rows at a time. Each output element is the same
// instruction sequence whatever R, M or the range boundaries are.
template <int M, int R, typename T>
void gemv_range_r(const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldx, int64_t ldo,
                  int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) block<M, R>(x, w, bias, out, K, ldo, n, ldx);
  for (; n < n_end; ++n) block<M, 1>(x, w, bias, out, K, ldo, n, ldx);
}

// gemv_range_r with R as measured for this build, M and K.
template <int M, typename T>
void gemv_range(const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldx, int64_t ldo,
                int64_t n_begin, int64_t n_end) {
  // AVX-512: one weight row a block streams the weights in one sequential run, which is what few input rows want
  // (bound by memory); with more rows each weight vector's `vdpbf16ps` / FMA needs its own input load, and loads
  // bound the loop: three weight rows a block then share each input load. Two threads, weights from memory, AMD
  // EPYC Zen 4, GMAC/s, three rows against one: bf16 8 rows 66 against 41 (K = 3072), 80 against 52 (K = 2048),
  // level at K = 1024 (57 against 60); 4 rows at K = 2048-3072 39-40 against 28-38, but 29-38 against 47-57 at
  // K = 1024; float32 8 rows 35-44 against 22-30 at every K (scripts/bench_gemv.py, R switched in a temporary build).
  if constexpr (Vec::W == 16 && M >= 4) {
    if (M >= 8 || K >= 2048) return gemv_range_r<M, 3>(x, w, bias, out, K, ldx, ldo, n_begin, n_end);
  }
  constexpr int kRegs = Vec::W == 4 ? 32 : 16;  // vector registers: NEON 32, AVX2 16 (+ loads in registers)
  // One weight row a block on AVX-512 below that: it beat 2 and 4 interleaved rows at every M on an AMD EPYC Zen 5
  // (SmolLM2's LM head, 49152 x 576: bf16 1.0-1.2 ms at M = 1-8 against up to 3.4 ms; float32 up to 1.4x at M =
  // 2-7). AVX2 and NEON keep R as measured there.
  constexpr int R = Vec::W == 16 ? 1 : (M * 4 + 5 <= kRegs ? 4 : (M * 2 + 3 <= kRegs ? 2 : 1));
  gemv_range_r<M, R>(x, w, bias, out, K, ldx, ldo, n_begin, n_end);
}

}  // namespace

template <typename T>
void gemv_rows(int64_t rows, const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldx, int64_t ldo,
               int64_t n_begin, int64_t n_end) {
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

template <typename T>
void gemv_many(int64_t M, const T* x, const T* w, const float* bias, T* out, int64_t K, int64_t ldx, int64_t ldo,
               int64_t n_begin, int64_t n_end) {
  // More than 8 rows: every 8 take one pass over a chunk of weight rows that stays in L2 (128 KiB), so the weights
  // come from memory once. Bf16, 16 rows, with three weight rows a block: 88-109 against 68-77 GMAC/s for one pass
  // over all the weights per 8 rows and one row a block (K = 1024-2048), 95 against 50 at K = 3072, 95 against 74
  // on a 151936 x 1024 LM head; float32 50-56 against 23-32 (the same machine and script as above).
  const int64_t chunk = M <= 8 ? n_end - n_begin : std::max<int64_t>(16, (128 << 10) / (K * int64_t(sizeof(T))));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += chunk) {
    const int64_t n1 = std::min(n_end, n0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += 8)
      gemv_rows(std::min<int64_t>(M - m0, 8), x + m0 * ldx, w, bias, out + m0 * ldo, K, ldx, ldo, n0, n1);
  }
}

template void gemv_many<float>(int64_t, const float*, const float*, const float*, float*, int64_t, int64_t, int64_t,
                               int64_t, int64_t);
template void gemv_many<bf16>(int64_t, const bf16*, const bf16*, const float*, bf16*, int64_t, int64_t, int64_t,
                              int64_t, int64_t);
template void gemv_rows<float>(int64_t, const float*, const float*, const float*, float*, int64_t, int64_t, int64_t,
                               int64_t, int64_t);
template void gemv_rows<bf16>(int64_t, const bf16*, const bf16*, const float*, bf16*, int64_t, int64_t, int64_t,
                              int64_t, int64_t);

namespace {

template <typename T>
void linear_typed(const torch::Tensor& x, const torch::Tensor& w, const float* bias, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldx = x.stride(0);
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 64,
                   [&](int64_t begin, int64_t end) { gemv_many(M, xp, wp, bias, op, K, ldx, N, begin, end); });
}

}  // namespace

torch::Tensor linear_small(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_small: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "linear_small: x and w both float32 or both bfloat16");
  TORCH_CHECK(w.is_contiguous() && x.stride(1) == 1, "linear_small: contiguous rows");
  TORCH_CHECK(x.size(1) % kStep == 0, "linear_small: K must be a multiple of 32");
  TORCH_CHECK(x.size(0) >= 1, "linear_small: at least one row");
  torch::Tensor b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kBFloat16) linear_typed<bf16>(x, w, bp, out);
  else linear_typed<float>(x, w, bp, out);
  return out;
}

}  // namespace peregrine
