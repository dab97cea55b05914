// linear_bf16: small-batch bfloat16 linear, out[M, N] = x[M, K] @ w[N, K]^T (+ bias).
// Decoding a few rows at a time is a matrix-vector product: every weight is read once per step and used M
// times, so the step is bound by memory bandwidth. oneDNN's bf16 GEMM reaches a fraction of it at M = 1; this
// streams each weight row once through `vdpbf16ps` (bf16 pairs multiplied, accumulated in float32), R rows at
// a time, for up to 8 inputs per pass. Each output element is computed by the same instructions in the same order
// whatever M is, so a sequence's logits do not depend on its batch mates.
#include "kernels.h"

namespace peregrine {
namespace {

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

}  // namespace

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

}  // namespace peregrine
