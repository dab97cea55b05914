// Greedy sampling's argmax.
#include "kernels.h"

namespace peregrine {

// Each row's index of its largest value, as torch.argmax gives it: the first such index, and a NaN counts as
// the largest. One thread: at 1-16 rows of a 50k vocabulary it is tens of microseconds, where torch's scalar
// reduction takes 0.25 ms a row (a greedy step's sampling).
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: float32 [rows, n > 0], contiguous");
  constexpr int64_t W = Vec::W;
  const int64_t R = x.size(0), N = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * N;
    Vec best = Vec::set1(-INFINITY);
    bool has_nan = false;
    int64_t i = 0;
    for (; i + W <= N; i += W) {
      const Vec v = Vec::load(row + i);
      has_nan |= v.any_nan();
      best = max(best, v);
    }
    float m = best.max();
    for (; i < N; ++i) {
      has_nan |= std::isnan(row[i]);
      m = std::max(m, row[i]);
    }
    int64_t at = 0;
    if (has_nan) {
      while (!std::isnan(row[at])) ++at;
    } else {
      const Vec target = Vec::set1(m);
      int64_t j = 0;
      for (; j + W <= N; j += W)
        if (Vec::load(row + j).any_eq(target)) break;
      while (row[j] != m) ++j;  // within the W that hit, or the tail
      at = j;
    }
    o[r] = at;
  }
  return out;
}

}  // namespace peregrine
