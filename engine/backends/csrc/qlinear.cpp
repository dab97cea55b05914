// qlinear: x[M, K] @ W[N, K]^T for W kept quantized (qdot.h), in int8 against activations quantized in blocks of 32,
// as the one-call decoder computes its matmuls on GGUF weights. Bound for tests and for callers outside the decoder.
#include "kernels.h"
#include "qdot.h"

namespace peregrine {

namespace {

torch::Tensor qlinear_on(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                         const c10::optional<torch::Tensor>& bias, bool amx) {
  namespace q = peregrine_quant;
  // Each check's message is one string: on an Intel Xeon with torch 2.11 and GCC 13.3 the process died where a check
  // formatted a number into its message (the arguments "text ", n); checks with one string raised as they should.
  TORCH_CHECK(q::supported(type), "qlinear: unsupported GGUF quantization type " + std::to_string(type));
  const q::Layout L = q::layout_of(static_cast<int>(type));
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qlinear: x [M, K] float32 or bfloat16, contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1 && K % L.elems == 0 &&
              w.size(1) == K / L.elems * L.bytes, "qlinear: weight [N, K / block * bytes] uint8 blocks");
  torch::Tensor b32;
  if (bias.has_value() && bias->numel()) b32 = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(!b32.defined() || b32.numel() == N, "qlinear: bias [N]");
  TORCH_CHECK(!q::tiled(static_cast<int>(type)) || (N % q::kTileRows == 0 && w.is_contiguous()),
              "qlinear: a tiled weight is whole tiles of 16 contiguous rows");
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldw = w.stride(0), ldx = x.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    q::QScratch s;
    s.amx = amx;
    q::QRows rows{};
    if (x.scalar_type() == at::kFloat)
      q::quantize_for(static_cast<int>(type), x.data_ptr<float>(), ldx, M, K, s, rows);
    else
      q::quantize_for(static_cast<int>(type), x.data_ptr<at::BFloat16>(), ldx, M, K, s, rows);
    q::qlinear_rows(static_cast<int>(type), wp, ldw, rows, M, bp, op, N, begin, end, s);
  });
  return out;
}

}  // namespace

torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                      const c10::optional<torch::Tensor>& bias) {
  return qlinear_on(x, w, type, bias, false);
}

torch::Tensor qlinear_amx(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(peregrine_quant::amx_int8_available(), "qlinear_amx: this build or CPU has no AMX int8 tiles");
  return qlinear_on(x, w, type, bias, true);
}

int64_t tile_rows() { return peregrine_quant::tile_rows(); }

bool amx_int8_available() { return peregrine_quant::amx_int8_available(); }

}  // namespace peregrine
