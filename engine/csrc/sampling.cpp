// Greedy sampling's argmax.
#include "kernels.h"

namespace peregrine {

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

}  // namespace peregrine
