// Small-batch bfloat16 linear for CPUs with AVX512-BF16: out[M, N] = x[M, K] @ w[N, K]^T (+ bias).
//
// Decoding a few rows at a time is a matrix-vector product: every weight is read once per step and used M
// times, so the step is bound by memory bandwidth. oneDNN's bf16 GEMM reaches a fraction of it at M = 1; this
// streams each weight row once through `vdpbf16ps` (bf16 pairs multiplied, accumulated in float32), R rows at
// a time, for up to 8 inputs per pass. Each output element is computed by the same instructions in the same order
// whatever M is, so a sequence's logits do not depend on its batch mates.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "bf16 x[M, K] @ w[N, K]^T (+ bias), AVX512-BF16");
}
