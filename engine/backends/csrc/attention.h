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
  int64_t b_end;   // rows b .. b_end - 1: one sequence's, each one position further (b_end = b + 1: one row)
};

constexpr int64_t kRowsPerItem = 32;  // a prompt's rows an item takes against one chunk

// Every (row, KV head, chunk) of a step, in a fixed order, each for its whole group of `group` query heads. A row
// is a sequence's query token. Rows of one sequence side by side (a prompt chunk's: the same block table, each one
// position further) share items: an item takes up to kRowsPerItem of them against one chunk, whose keys and values
// are then read from memory once for those rows, not once per row (a 4k prompt's rows would each read the whole
// context). A group of rows takes all its chunks before the next group starts, so its partials are merged (by the
// decoder, as soon as a row's last item is done) while they are still in cache: a 512-row step at 4k of context
// writes about 78 MB of partials a layer, which chunk-major order sent to memory and back. Neither the order nor
// the sharing changes what is computed for a row.
inline std::vector<AttnItem> attn_items(const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group,
                                        const int64_t* block_tables = nullptr, int64_t max_blocks = 0) {
  std::vector<AttnItem> items;
  for (int64_t b0 = 0, b1; b0 < batch; b0 = b1) {
    for (b1 = b0 + 1; block_tables && b1 < batch && lengths[b1] == lengths[b1 - 1] + 1 &&
                      std::equal(block_tables + b1 * max_blocks, block_tables + (b1 + 1) * max_blocks,
                                 block_tables + b0 * max_blocks);
         ++b1) {
    }
    for (int64_t r0 = b0; r0 < b1; r0 += kRowsPerItem) {  // the run's rows, kRowsPerItem at a time
      const int64_t r1 = std::min(r0 + kRowsPerItem, b1);
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
        for (int64_t c = 0, first = r0; c < attn_chunks(lengths[r1 - 1]); ++c) {
          while (c >= attn_chunks(lengths[first])) ++first;  // the group's rows that reach chunk c: a suffix
          items.push_back({first, kvh, c, 0, group, r1});
        }
    }
  }
  return items;
}

// Scratch for one thread's attention items, reused across items.
struct AttnScratch {
  std::vector<float> scores;
  std::vector<Vec> qv, acc;
  std::vector<float> kf, vf;  // an int8 cache's chunk rows, dequantized once for an item's rows
};

// An int8 KV cache (`--kv-cache-dtype int8`) keeps each (slot, KV head) row of `dim` values as int8 q with one
// float scale s = max|x| / 127, x ~ s * q, q = round(x / s) to nearest even: engine/model/kv_cache.py's
// `quantize_kv` does the same operations, so the decoder and the op-by-op pass store the same bits.
inline void quantize_kv_row(const float* x, int64_t dim, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / 127.f, div = std::max(s, std::numeric_limits<float>::min());
  for (int64_t i = 0; i < dim; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / div), -127.f, 127.f));
  *scale = s;
}

// One work item: per query head of the item's GQA group, the chunk's scores, softmax numerators and weighted V sum.
// q in T (the model dtype), the caches in C: T, float16 (a KV cache in half the bytes) or int8 (a quarter of
// float32's, with `k_scales` and `v_scales` [slots, KVH]: a position's score is its dot product with the widened
// values times its K scale, its softmax weight is taken times its V scale; an item of several rows widens the chunk
// once). `window` > 0: only the last `window` positions of the
// context count (a sliding-window layer); a chunk wholly before them is empty. `cap` > 0: each score x becomes cap *
// tanh(x / cap) before the softmax (Gemma 2's attention logit soft-capping).
template <typename T, typename C>
void attend_chunk(const AttnItem& item, const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                  const int64_t* lengths, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_blocks,
                  int64_t block_size, float scale, AttnPartials& partials, AttnScratch& s, int64_t window = 0,
                  float cap = 0.f, const float* k_scales = nullptr, const float* v_scales = nullptr);

// out[b, h] from the head's chunks, combined in chunk order.
template <typename T>
void merge_chunks(int64_t b, int64_t h, const int64_t* lengths, T* out, int64_t heads, int64_t dim,
                  AttnPartials& partials);

}  // namespace peregrine
