// Paged decode attention's shared pieces: the work items and partial results that attention.cpp's entry point and
// the decoder (decoder.cpp) both use.
#pragma once

#include "kernels.h"

namespace peregrine {

// Decode attention in fixed chunks of context positions (flash-decoding's split): a work item is one sequence, one
// KV head and one chunk, for the whole GQA group of query heads that share the K and V rows; a merge then combines
// a head's chunks in order. Chunks are fixed by position, never by how many sequences or threads there are, so a
// sequence's attention output is the same bits whatever its batch mates, and one long sequence still keeps every
// thread busy.
constexpr int64_t kAttnChunk = 64;

inline int64_t attn_chunks(int64_t len) { return (len + kAttnChunk - 1) / kAttnChunk; }

// Per (sequence, query head, chunk): dim floats of the weighted V sum relative to the chunk's max score, then that
// max, then the chunk's sum of exp(score - max).
struct AttnPartials {
  std::vector<float> data;
  int64_t heads = 0, cap = 0, dim = 0;
  void reset(const int64_t* lengths, int64_t batch, int64_t h, int64_t d) {
    heads = h, cap = batch ? attn_chunks(*std::max_element(lengths, lengths + batch)) : 0, dim = d;
    data.resize(static_cast<size_t>(batch * heads * cap * (dim + 2)));
  }
  float* at(int64_t b, int64_t h, int64_t chunk) { return data.data() + ((b * heads + h) * cap + chunk) * (dim + 2); }
};

struct AttnItem {
  int64_t b, kvh, chunk;
  int64_t g0, g1;  // the query heads g0 .. g1 of the KV head's GQA group
};

// Every (sequence, KV head, chunk) of a step, in a fixed order, each for its whole group of `group` query heads.
inline std::vector<AttnItem> attn_items(const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group) {
  std::vector<AttnItem> items;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t c = 0; c < attn_chunks(lengths[b]); ++c) items.push_back({b, kvh, c, 0, group});
  return items;
}

// Scratch for one thread's attention items, reused across items.
struct AttnScratch {
  std::vector<float> scores;
  std::vector<Vec> qv, acc;
};

// One work item: per query head of the item's GQA group, the chunk's scores, softmax numerators and weighted V sum.
// q in T (the model dtype), the caches in C: T, or float16 (a KV cache in half the bytes). `window` > 0: only the
// last `window` positions of the context count (a sliding-window layer); a chunk wholly before them is empty.
template <typename T, typename C>
void attend_chunk(const AttnItem& item, const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                  const int64_t* lengths, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_blocks,
                  int64_t block_size, float scale, AttnPartials& partials, AttnScratch& s, int64_t window = 0);

// out[b, h] from the head's chunks, combined in chunk order.
template <typename T>
void merge_chunks(int64_t b, int64_t h, const int64_t* lengths, T* out, int64_t heads, int64_t dim,
                  AttnPartials& partials);

}  // namespace peregrine
