// Residual add and RMSNorm in one pass, with transformers' LlamaRMSNorm rounding.
#include "kernels.h"

namespace peregrine {

template <typename T>
void add_rms_norm_row(T* hr, const T* dr, const T* weight, T* out, int64_t hidden, float eps) {
  constexpr int64_t W = Vec::W;
  Vec sumsq = Vec::zero();
  int64_t i = 0;
  for (; i + W <= hidden; i += W) {
    Vec v = Vec::load(hr + i);
    if (dr) {
      v = round_to<T>(v + Vec::load(dr + i));
      v.store(hr + i);
    }
    sumsq = fmadd(v, v, sumsq);
  }
  float tail = 0.f;
  for (; i < hidden; ++i) {
    if (dr) hr[i] = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
    const float v = static_cast<float>(hr[i]);
    tail += v * v;
  }
  const float inv = 1.f / std::sqrt((sumsq.sum() + tail) / static_cast<float>(hidden) + eps);
  const Vec vinv = Vec::set1(inv);
  for (i = 0; i + W <= hidden; i += W) {
    const Vec normed = round_to<T>(Vec::load(hr + i) * vinv);  // rounded to the model dtype, then scaled
    (Vec::load(weight + i) * normed).store(out + i);
  }
  for (; i < hidden; ++i) {
    const T normed = static_cast<T>(static_cast<float>(hr[i]) * inv);
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

template void add_rms_norm_row<float>(float*, const float*, const float*, float*, int64_t, float);
template void add_rms_norm_row<bf16>(bf16*, const bf16*, const bf16*, bf16*, int64_t, float);

namespace {

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

}  // namespace peregrine
