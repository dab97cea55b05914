// The one-call decoder's matmuls (decoder.cpp): each is made of parts, dense in the model dtype or GGUF blocks kept
// quantized (qdot.h's int8 dot products), and a thread computes its share of the output rows with linear_rows.
#pragma once

#include "attention.h"
#include "qdot.h"

namespace peregrine {
namespace {

namespace q = peregrine_quant;

struct Scratch {
  AmxScratch amx;
  AttnScratch attn;
  q::QScratch quant;
};

// One block of a matmul's output rows: dense weights in the model dtype ([rows, K], contiguous), or GGUF blocks
// kept quantized (uint8 [rows, bytes], `qtype` the ggml type). A fused projection whose pieces come in different
// formats (Q4_K_M files mix Q4_K and Q6_K) is several parts.
struct Part {
  torch::Tensor weight;
  int qtype = 0;
  int64_t n0 = 0, rows = 0;
};

struct Linear {
  std::vector<Part> parts;
  torch::Tensor bias;  // float32, undefined when absent
  const uint16_t* packed = nullptr;  // the AMX layout (pack_weight), in the decoder's packed buffer
  int64_t N = 0, K = 0;
  float scale = 1.f, divisor = 1.f;  // the outputs, rounded to T, then times `scale` or over `divisor` (Granite)
  float cap = 0.f;  // then cap * tanh(out / cap), rounded to T (Gemma 2's logits; 0: none)
  bool dense() const { return parts.size() == 1 && parts[0].qtype == 0; }
};

// out[:M, n_begin:n_end] = x[:M] @ w[n_begin:n_end]^T (+ bias). n_begin and n_end are multiples of 16; with AMX
// (bf16 only) n_begin is a multiple of 32 and n_end one too or N. Quantized parts multiply the rows quantized to
// int8 (qdot.h) into `qx` by the first of them: calls on the same x may share one (empty at first), or take a fresh
// one each (the overload without it).
template <typename T>
void linear_rows_unscaled(const Linear& L, const T* x, int64_t ldx, int64_t M, T* out, int64_t ldo, int64_t n_begin,
                          int64_t n_end, bool amx, Scratch& s, q::QRows& qx) {
  const float* bias = L.bias.defined() ? L.bias.data_ptr<float>() : nullptr;
  if (n_begin >= n_end) return;
  if constexpr (std::is_same_v<T, bf16>) {
    if (amx && L.packed) {
      amx_rows(L.packed, L.N, L.K, bias, reinterpret_cast<const uint16_t*>(x), ldx, M, out, ldo, n_begin, n_end,
               s.amx);
      return;
    }
  }
  for (const Part& p : L.parts) {
    const int64_t b = std::max(n_begin, p.n0) - p.n0, e = std::min(n_end, p.n0 + p.rows) - p.n0;
    if (b >= e) continue;
    const float* pb = bias ? bias + p.n0 : nullptr;
    if (p.qtype) {
      q::quantize_for(p.qtype, x, ldx, M, L.K, s.quant, qx);
      q::qlinear_rows(p.qtype, p.weight.data_ptr<uint8_t>(), p.weight.stride(0), qx, M, pb, out + p.n0, ldo, b, e,
                      s.quant);
      continue;
    }
    const T* w = p.weight.data_ptr<T>();
    gemv_many(M, x, w, pb, out + p.n0, L.K, ldx, ldo, b, e);
  }
}

// linear_rows_unscaled, then the outputs scaled as transformers' `out * multiplier` or `out / divisor` round them,
// then soft-capped (L.cap).
template <typename T>
void linear_rows(const Linear& L, const T* x, int64_t ldx, int64_t M, T* out, int64_t ldo, int64_t n_begin,
                 int64_t n_end, bool amx, Scratch& s, q::QRows& qx) {
  linear_rows_unscaled(L, x, ldx, M, out, ldo, n_begin, n_end, amx, s, qx);
  const int64_t end = std::min(n_end, L.N);
  if (L.scale != 1.f || L.divisor != 1.f)
    for (int64_t m = 0; m < M; ++m)
      for (T* o = out + m * ldo + n_begin; o < out + m * ldo + end; ++o)
        *o = static_cast<T>(L.divisor == 1.f ? static_cast<float>(*o) * L.scale : static_cast<float>(*o) / L.divisor);
  if (L.cap > 0.f)  // a vector at a time (a 256k vocabulary's tanh one by one was milliseconds a step)
    for (int64_t m = 0; m < M; ++m) {
      T* row = out + m * ldo;
      int64_t n = n_begin;
      for (; n + Vec::W <= end; n += Vec::W) soft_cap(Vec::load(row + n), L.cap).store(row + n);
      for (; n < end; ++n) row[n] = static_cast<T>(L.cap * std::tanh(static_cast<float>(row[n]) / L.cap));
    }
}

template <typename T>
void linear_rows(const Linear& L, const T* x, int64_t ldx, int64_t M, T* out, int64_t ldo, int64_t n_begin,
                 int64_t n_end, bool amx, Scratch& s) {
  q::QRows qx{};
  linear_rows(L, x, ldx, M, out, ldo, n_begin, n_end, amx, s, qx);
}

template <typename T>
constexpr at::ScalarType kType = std::is_same_v<T, float>    ? at::kFloat
                                 : std::is_same_v<T, f16>    ? at::kHalf
                                 : std::is_same_v<T, int8_t> ? at::kChar
                                                             : at::kBFloat16;

// A matmul from its parts (each dense in T or GGUF blocks of `types[i]`), stacked along the output rows.
template <typename T>
Linear make_linear(const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types, const torch::Tensor& bias) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "LlamaDecoder: each linear's parts, one type each");
  Linear L;
  for (size_t i = 0; i < ws.size(); ++i) {
    const torch::Tensor& w = ws[i];
    TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "LlamaDecoder: weights [N, K] with contiguous rows");
    Part p{w, static_cast<int>(types[i]), L.N, w.size(0)};
    int64_t K = w.size(1);
    if (p.qtype == 0) {
      TORCH_CHECK(w.is_contiguous() && w.scalar_type() == kType<T>, "LlamaDecoder: dense weights in the model dtype");
    } else {
      TORCH_CHECK(q::supported(p.qtype), "LlamaDecoder: unsupported GGUF quantization type " + std::to_string(p.qtype));
      const q::Layout lay = q::layout_of(p.qtype);
      TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) % lay.bytes == 0, "LlamaDecoder: uint8 rows of blocks");
      TORCH_CHECK(!q::tiled(p.qtype) || (w.size(0) % q::kTileRows == 0 && w.is_contiguous()),
                  "LlamaDecoder: a tiled weight is whole tiles of 16 contiguous rows");
      K = w.size(1) / lay.bytes * lay.elems;
    }
    TORCH_CHECK(i == 0 || K == L.K, "LlamaDecoder: a linear's parts differ in K");
    L.K = K;
    L.N += p.rows;
    L.parts.push_back(std::move(p));
  }
  TORCH_CHECK(L.N % 16 == 0 && L.K % 32 == 0, "LlamaDecoder: weight rows % 16, columns % 32");
  if (bias.defined() && bias.numel()) L.bias = bias.to(at::kFloat).contiguous();
  TORCH_CHECK(!L.bias.defined() || L.bias.numel() == L.N, "LlamaDecoder: a bias per output row");
  return L;
}

}  // namespace
}  // namespace peregrine
