// The one-call decoder's helpers (decoder.cpp): its packed-weight buffer, the step's spin barrier, how a step's
// attention items and output columns are shared out among threads, and the per-element RoPE and SiLU * up.
#pragma once

#include "decoder_linear.h"

#include <omp.h>
#include <sched.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <memory>

namespace peregrine {
namespace {

// One allocation for all packed weights, in the order a step reads them, on transparent huge pages where the
// kernel grants them (fewer TLB misses along the stream).
struct PackedBuffer {
  uint16_t* data = nullptr;
  explicit PackedBuffer(int64_t elements) {
    constexpr size_t huge = size_t(2) << 20;
    const size_t bytes = (static_cast<size_t>(elements) * 2 + kAheadBytes + huge - 1) / huge * huge;
    data = static_cast<uint16_t*>(std::aligned_alloc(huge, bytes));
    TORCH_CHECK(data, "LlamaDecoder: cannot allocate " + std::to_string(bytes) + " bytes for the packed weights");
    madvise(data, bytes, MADV_HUGEPAGE);
  }
  ~PackedBuffer() { std::free(data); }
  PackedBuffer(const PackedBuffer&) = delete;
  PackedBuffer& operator=(const PackedBuffer&) = delete;
};

// A spin barrier for the step's thread team (a passive OpenMP barrier would sleep in the kernel at every phase).
struct SpinBarrier {
  int n = 1;
  std::atomic<int> arrived{0}, phase{0};
  void wait() {
    if (n == 1) return;
    const int p = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(p + 1, std::memory_order_release);
      return;
    }
    // A phase ends within microseconds of its mates when every thread has a core. When one has lost its core
    // (the server's event loop, a client on the same machine), spinning on would keep it off: yield soon.
    for (int spins = 0; phase.load(std::memory_order_acquire) == p; ++spins) {
      if (spins < 256) cpu_relax();
      else sched_yield();
    }
  }
};

// Up to this many residual elements (rows * hidden) every thread of a step normalizes all the rows itself instead
// of its share of them before a barrier: a row of 576 takes tens of nanoseconds, a barrier a few hundred (AMD EPYC
// Zen 5 under KVM), and each thread's x then sits in its own cache for its share of the next matmul.
constexpr int64_t kOwnRowsElements = 8192;

// Fewer attention items than this per thread (a short context, few sequences) are split into one item per query
// head, so that they share out evenly: 3 KV heads of one short sequence on 2 threads were 2 items against 1.
constexpr size_t kItemsPerThread = 4;

// Thread t's attention items are items[begin[t]] .. items[begin[t + 1]]: consecutive items holding about 1 / threads
// of the step's work (context positions times query heads) each. Items differ in size (a sequence's last chunk is
// partial), and round robin gave one thread most of it.
inline std::vector<size_t> split_items(const std::vector<AttnItem>& items, const int64_t* lengths, int threads) {
  auto positions = [&](const AttnItem& it) {
    int64_t n = 0;
    for (int64_t b = it.b; b < it.b_end; ++b) n += std::min(kAttnChunk, lengths[b] - it.chunk * kAttnChunk);
    return n * (it.g1 - it.g0);
  };
  int64_t total = 0;
  for (const AttnItem& it : items) total += positions(it);
  std::vector<size_t> begin(threads + 1, items.size());
  int next = 0;
  int64_t at = 0;
  for (size_t i = 0; i < items.size(); ++i) {  // an item goes to the thread whose share holds its middle
    const int64_t n = positions(items[i]);
    const int owner = static_cast<int>((2 * at + n) * threads / (2 * std::max<int64_t>(total, 1)));
    while (next <= owner) begin[next++] = i;
    at += n;
  }
  return begin;
}

// [begin, end) of thread t's share of `units` * `align` items.
inline std::pair<int64_t, int64_t> share(int64_t items, int64_t align, int t, int threads) {
  const int64_t units = items / align;
  return {units * t / threads * align, units * (t + 1) / threads * align};
}

// transformers' rotate-half RoPE in T: to_T(to_T(x * cos) + to_T(rotate_half(x) * sin)), stored as S (T, or a
// float16 cache's element: then rounded once more, as the op-by-op pass's `k.to(cache.dtype)` does). Only the
// first `rotary` dims turn (partial rotary: Phi-4-mini); the rest are copied.
template <typename T, typename S>
inline void rope_head(const T* x, const T* cos, const T* sin, S* dst, int64_t dim, int64_t rotary) {
  const int64_t half = rotary / 2;
  for (int64_t i = rotary; i < dim; ++i) dst[i] = static_cast<S>(static_cast<float>(x[i]));
  for (int64_t i = 0; i < rotary; ++i) {
    const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const T b = static_cast<T>(rotated * static_cast<float>(sin[i]));
    dst[i] = static_cast<S>(static_cast<float>(static_cast<T>(static_cast<float>(a) + static_cast<float>(b))));
  }
}

// act = to_T(to_T(silu(gate)) * up), Vec::W elements.
template <typename T>
inline void silu_mul(const T* gate, const T* up, T* act) {
  const Vec g = Vec::load(gate), u = Vec::load(up), one = Vec::set1(1.f);
  const Vec e = exp_nonpositive(Vec::zero() - abs(g));  // exp(-|g|)
  const Vec inv = one / (one + e);
  const Vec sigmoid = select_ge0(g, inv, e * inv);
  (round_to<T>(g * sigmoid) * u).store(act);
}

// act = to_T(to_T(gelu_tanh(gate)) * up), Vec::W elements (Gemma's GeGLU; transformers' gelu_pytorch_tanh):
// 0.5 * (1 + tanh(y)) is sigmoid(2y), so gelu_tanh(g) = g * sigmoid(2 * sqrt(2 / pi) * (g + 0.044715 g^3)), through
// silu's vector exp (libm's tanhf, one element at a time, had been 8% of a 16-row Gemma-3-1B decode step).
template <typename T>
inline void gelu_tanh_mul(const T* gate, const T* up, T* act) {
  const Vec g = Vec::load(gate), u = Vec::load(up), one = Vec::set1(1.f);
  const Vec y = Vec::set1(1.5957691216057308f) * fmadd(Vec::set1(0.044715f) * g * g, g, g);
  const Vec e = exp_nonpositive(Vec::zero() - abs(y));  // exp(-|y|)
  const Vec inv = one / (one + e);
  const Vec sigmoid = select_ge0(y, inv, e * inv);
  (round_to<T>(g * sigmoid) * u).store(act);
}

}  // namespace
}  // namespace peregrine
