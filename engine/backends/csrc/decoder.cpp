// LlamaDecoder: a whole decode step of a Llama-block model in one call: Llama, SmolLM, Mistral, Qwen2, and the
// families whose differences engine/model/families.py lists and `configure` hands over (Qwen3's q/k norms,
// Granite's multipliers, Phi-3's partial rotary, Gemma 3's output norms, GeGLU, sliding windows and RoPE tables).
//
// At batch 1 the weights are read once per token and everything else is tiny vectors, so what costs time besides
// the weight stream is per-op overhead: Python dispatch and waking the thread team for each of the ~15 ops of
// each layer. Here the step is one parallel region: the threads split each matmul's output rows and meet at a
// spin barrier between phases (as llama.cpp's thread pool does), six a layer: QKV; RoPE and the cache
// store; attention, each (sequence, KV head) merged by the thread that attends its last chunk; O; gate/up with
// SiLU * up on the same thread's share; down (with many rows, two more after the norms, whose rows are shared;
// with few, each thread normalizes them all itself). The matmuls run on AMX tiles where the CPU has them
// (Sapphire Rapids and later): the decoder keeps a copy of the weights packed as B tiles in the order a step
// reads them (pack_weight), so the weight stream runs front to back near the plain read speed, and the step's
// 1-32 input rows are the A tiles, read in place. One instruction sequence serves every batch size, so a row's
// output does not depend on its batch mates. Without AMX (and always in float32) the matmuls are linear.cpp's rows
// on the model's own weights (no copy). GGUF weights kept quantized are multiplied in int8 against the step's
// activations quantized in blocks of 32 (qdot.h, as llama.cpp does), each weight row unpacked once per step for
// every input row; a projection fused from pieces of different formats is a matmul of several parts
// (decoder_linear.h), and a quantized embedding table is dequantized row by row at the lookup. The decoder is a
// template over the model dtype T (float or bf16), bound as LlamaDecoder_float32 and LlamaDecoder_bfloat16, and over
// the KV caches' element C: T, float16 (`--kv-cache-dtype float16`, the _kv_float16 bindings: half the bytes a
// step's attention reads) or int8 (`--kv-cache-dtype int8`, the _kv_int8 bindings: a scale per row of head_dim
// values, attention.h's quantize_kv_row, a quarter of float32's bytes and a little). The rounding to T follows
// engine/model/forward.py op for op (RoPE, SiLU * up, norms, matmul outputs), and keys and values go to C as its
// `k.to(cache.dtype)` rounds them (an int8 cache: as its kv_cache.quantize_kv does).
#include "decoder_parts.h"

namespace peregrine {
namespace {

struct DecoderLayer {
  torch::Tensor input_norm, post_norm, k_cache, v_cache;
  torch::Tensor k_scale, v_scale;  // an int8 cache's row scales [slots, KVH] float32; undefined otherwise
  torch::Tensor q_norm, k_norm;  // per-head RMSNorm weights [head_dim] before RoPE (Qwen3); undefined when absent
  torch::Tensor attn_out_norm, mlp_out_norm;  // RMSNorm of o's and down's outputs before the residual add (Gemma 3)
  int64_t window = 0;  // attends the last `window` positions (a sliding-window layer); 0: all
  int64_t rope_table = 0;  // which of the step's RoPE tables (Gemma 3's local layers have their own base)
  Linear qkv, o, gate_up, down;
};

}  // namespace

template <typename T, typename C = T>
class LlamaDecoder {
  static constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;

 public:
  // embed: [vocab, hidden] in T, or GGUF blocks of `embed_qtype` (uint8 [vocab, bytes]). layers: per layer
  // [input_norm, post_norm, k_cache, v_cache], and for an int8 cache its [k_scale, v_scale]. weights: per matmul
  // (qkv, o, gate_up, down of each layer, then the LM head) its parts, `qtypes` their types (0: dense in T) and
  // `biases` one per matmul (empty when absent). qkv rows: q heads, then k heads, then v heads. AMX (bf16) takes
  // the dense matmuls when every one is a single dense part.
  LlamaDecoder(const torch::Tensor& embed, int64_t embed_qtype, const std::vector<std::vector<torch::Tensor>>& layers,
               const std::vector<std::vector<torch::Tensor>>& weights, const std::vector<std::vector<int64_t>>& qtypes,
               const std::vector<torch::Tensor>& biases, const torch::Tensor& final_norm, int64_t heads,
               int64_t kv_heads, int64_t head_dim, double eps, int64_t block_size, double scale, bool amx)
      : embed_(embed), embed_qtype_(static_cast<int>(embed_qtype)), final_norm_(final_norm), heads_(heads),
        kv_heads_(kv_heads), dim_(head_dim), eps_(eps), block_size_(block_size), scale_(scale),
        amx_(amx && std::is_same_v<T, bf16>), amx_int8_(amx && q::amx_int8_available()) {
    // amx_: bf16 tiles for dense weights (below); amx_int8_: int8 tiles for tiled quantized ones
    TORCH_CHECK(!amx || amx_available(), "LlamaDecoder: AMX is not available");
    TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 512 && heads % kv_heads == 0, "LlamaDecoder: head_dim % 32, GQA");
    const size_t n = layers.size();
    TORCH_CHECK(weights.size() == 4 * n + 1 && qtypes.size() == weights.size() && biases.size() == weights.size(),
                "LlamaDecoder: 4 matmuls per layer and the LM head, each with its types and bias");
    auto linear = [&](size_t i) { return make_linear<T>(weights[i], qtypes[i], biases[i]); };
    head_ = linear(4 * n);
    hidden_ = head_.K;
    for (size_t i = 0; i < n; ++i) {
      const auto& t = layers[i];
      TORCH_CHECK(t.size() == (kInt8Cache ? 6 : 4),
                  "LlamaDecoder: input_norm, post_norm, k_cache, v_cache (an int8 cache: k_scale, v_scale) per layer");
      DecoderLayer l;
      l.input_norm = t[0];
      l.post_norm = t[1];
      l.k_cache = t[2];
      l.v_cache = t[3];
      if constexpr (kInt8Cache) {
        l.k_scale = t[4];
        l.v_scale = t[5];
        for (const auto* c : {&l.k_scale, &l.v_scale})
          TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->dim() == 2 &&
                      c->size(0) == t[2].size(0) && c->size(1) == kv_heads,
                      "LlamaDecoder: an int8 cache's scales [slots, KVH] float32");
      }
      l.qkv = linear(4 * i);
      l.o = linear(4 * i + 1);
      l.gate_up = linear(4 * i + 2);
      l.down = linear(4 * i + 3);
      TORCH_CHECK(l.qkv.N == (heads + 2 * kv_heads) * head_dim && l.qkv.K == hidden_ && l.o.N == hidden_ &&
                  l.o.K == heads * head_dim && l.gate_up.K == hidden_ && l.down.N == hidden_ &&
                  l.gate_up.N == 2 * l.down.K && l.down.K % 16 == 0, "LlamaDecoder: inconsistent shapes");
      for (const auto* nw : {&l.input_norm, &l.post_norm})
        TORCH_CHECK(nw->scalar_type() == kType<T> && nw->is_contiguous() && nw->numel() == hidden_,
                    "LlamaDecoder: norm weights [hidden] in the model dtype");
      for (const auto* c : {&l.k_cache, &l.v_cache})
        TORCH_CHECK(c->scalar_type() == kType<C> && c->is_contiguous() && c->dim() == 3 &&
                    c->size(1) == kv_heads && c->size(2) == head_dim,
                    std::string("LlamaDecoder: caches [slots, KVH, D] in ") + c10::toString(kType<C>));
      layers_.push_back(std::move(l));
    }
    TORCH_CHECK(final_norm.scalar_type() == kType<T> && final_norm.numel() == hidden_, "LlamaDecoder: final norm");
    TORCH_CHECK(embed.dim() == 2 && embed.stride(1) == 1, "LlamaDecoder: embeddings [vocab, hidden]");
    if (embed_qtype_) {
      TORCH_CHECK(q::supported(embed_qtype_) && embed.scalar_type() == at::kByte &&
                  (!q::tiled(embed_qtype_) || (embed.size(0) % q::kTileRows == 0 && embed.is_contiguous())) &&
                  hidden_ % q::layout_of(embed_qtype_).elems == 0 &&
                  embed.size(1) == hidden_ / q::layout_of(embed_qtype_).elems * q::layout_of(embed_qtype_).bytes,
                  "LlamaDecoder: quantized embeddings [vocab, hidden / block * bytes] uint8");
    } else {
      TORCH_CHECK(embed.scalar_type() == kType<T> && embed.is_contiguous() && embed.size(1) == hidden_,
                  "LlamaDecoder: embeddings [vocab, hidden] in the model dtype");
    }
    for (const auto& l : layers_) {
      for (const Linear* L : {&l.qkv, &l.o, &l.gate_up, &l.down}) amx_ = amx_ && L->dense();
      amx_ = amx_ && l.down.K % 32 == 0;  // gate_up's rows split in whole AMX blocks at gate row j and up row I + j
    }
    amx_ = amx_ && head_.dense();
    if (amx_) pack_all();
  }

  // How the model's block differs from Llama's (engine/model/families.py): per layer the q and k per-head norm
  // weights and the o / down output norms (empty lists when the family has none), its window (0: none) and RoPE
  // table; the scale of the looked-up embeddings, of each block's output before the residual add (o and down),
  // the divisor of the logits, the MLP's activation (GELU-tanh instead of SiLU), and the soft caps of the attention
  // scores and of the logits (Gemma 2: cap * tanh(x / cap); 0: none). Called once, before any step.
  void configure(const std::vector<torch::Tensor>& qk_norms, const std::vector<torch::Tensor>& out_norms,
                 const std::vector<int64_t>& windows, const std::vector<int64_t>& rope_tables, double embed_scale,
                 double residual_scale, double logit_div, bool gelu, double attn_softcap, double final_softcap) {
    const size_t n = layers_.size();
    TORCH_CHECK((qk_norms.empty() || qk_norms.size() == 2 * n) && (out_norms.empty() || out_norms.size() == 2 * n) &&
                windows.size() == n && rope_tables.size() == n, "LlamaDecoder: norms, window and RoPE table per layer");
    for (size_t i = 0; i < qk_norms.size(); ++i)
      (i % 2 ? layers_[i / 2].k_norm : layers_[i / 2].q_norm) = checked_norm(qk_norms[i], dim_);
    for (size_t i = 0; i < out_norms.size(); ++i)
      (i % 2 ? layers_[i / 2].mlp_out_norm : layers_[i / 2].attn_out_norm) = checked_norm(out_norms[i], hidden_);
    rope_tables_ = 1;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(windows[i] >= 0 && rope_tables[i] >= 0 && rope_tables[i] < 8, "LlamaDecoder: window, RoPE table");
      layers_[i].window = windows[i];
      layers_[i].rope_table = rope_tables[i];
      rope_tables_ = std::max(rope_tables_, rope_tables[i] + 1);
    }
    TORCH_CHECK(attn_softcap >= 0.0 && final_softcap >= 0.0, "LlamaDecoder: soft caps are positive, or 0 for none");
    embed_scale_ = embed_scale;
    gelu_ = gelu;
    softcap_ = attn_softcap;
    for (auto& l : layers_) l.o.scale = l.down.scale = static_cast<float>(residual_scale);
    head_.divisor = static_cast<float>(logit_div);
    head_.cap = static_cast<float>(final_softcap);
  }

  // ids [B] (this step's tokens), rope_rows [B] (each token's row of the RoPE tables cos and sin [rows, head_dim]),
  // slots [B], block_tables [B, max_blocks], lengths [B] (context tokens, this one included). Returns float32 logits
  // [S, vocab] holding the T values the LM head rounds to, for the rows `head_rows` [S] names (in that order; None:
  // every row): a prefill chunk samples from its last row only, and the LM head of a 128k vocabulary is a fifth of
  // a 1B model's weights, so the others skip it. A row's logits are the same whichever rows come with it.
  // Embedding lookup to logits is one call, so no torch op runs between steps on caches the weight stream has just
  // flushed.
  torch::Tensor step(const torch::Tensor& ids, const torch::Tensor& rope_rows, const torch::Tensor& cos,
                     const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& block_tables,
                     const torch::Tensor& lengths, const c10::optional<torch::Tensor>& head_rows) {
    auto tok = ids.to(at::kLong).contiguous(), rope = rope_rows.to(at::kLong).contiguous();
    torch::Tensor cs = cos.to(kType<T>).contiguous(), sn = sin.to(kType<T>).contiguous();
    auto slot = slots.to(at::kLong).contiguous(), tables = block_tables.to(at::kLong).contiguous();
    auto lens = lengths.to(at::kLong).contiguous();
    const int64_t B = tok.numel(), H = heads_, KVH = kv_heads_, D = dim_, hid = hidden_;
    TORCH_CHECK(rope.numel() == B && slot.numel() == B && tables.size(0) == B && lens.numel() == B,
                "LlamaDecoder.step: one RoPE row, slot, table and length per token");
    const int64_t R = cs.size(1);  // the rotated dims: head_dim, or fewer (partial rotary, Phi-4-mini)
    const int64_t table_rows = cs.size(0) / rope_tables_;  // each RoPE table's rows (rope_rows index one table)
    TORCH_CHECK(cs.dim() == 2 && R <= D && R % 2 == 0 && sn.sizes() == cs.sizes(),
                "LlamaDecoder.step: cos, sin [rows, rotary dims <= head_dim]");
    const int64_t *tokp = tok.data_ptr<int64_t>(), *ropep = rope.data_ptr<int64_t>();
    for (int64_t m = 0; m < B; ++m)
      TORCH_CHECK(tokp[m] >= 0 && tokp[m] < embed_.size(0) && ropep[m] >= 0 && ropep[m] < table_rows,
                  "LlamaDecoder.step: token id or RoPE row out of range");
    const auto sel = head_rows.has_value() && head_rows->defined() ? head_rows->to(at::kLong).contiguous()
                                                                    : torch::arange(B, at::kLong);
    const int64_t S = sel.numel();
    const int64_t* selp = sel.data_ptr<int64_t>();
    bool every_row = S == B;  // every row in order (a decode-only step): no gather
    for (int64_t i = 0; i < S; ++i) {
      TORCH_CHECK(selp[i] >= 0 && selp[i] < B, "LlamaDecoder.step: a head row out of range");
      every_row = every_row && selp[i] == i;
    }
    const int64_t group = H / KVH, QKV = (H + 2 * KVH) * D, I = layers_.empty() ? 0 : layers_[0].down.K, V = head_.N;
    auto opts = final_norm_.options();  // T (the embeddings may be uint8 blocks)
    auto h = torch::empty({B, hid}, opts);  // the residual stream, from the embeddings
    if (embed_qtype_) {  // the looked-up rows dequantized, rounded to T
      std::vector<float> row(hid);
      for (int64_t m = 0; m < B; ++m) {
        q::dequant_row_at(embed_qtype_, embed_.data_ptr<uint8_t>(), embed_.stride(0), tokp[m], hid, row.data());
        std::copy_n(row.data(), hid, h.data_ptr<T>() + m * hid);
      }
    } else {
      for (int64_t m = 0; m < B; ++m)
        std::copy_n(embed_.data_ptr<T>() + tokp[m] * hid, hid, h.data_ptr<T>() + m * hid);
    }
    if (embed_scale_ != 1.0)  // Granite's embedding multiplier, Gemma's sqrt(hidden): rounded to T as torch does
      for (T* e = h.data_ptr<T>(); e < h.data_ptr<T>() + B * hid; ++e)
        *e = static_cast<T>(static_cast<float>(*e) * static_cast<float>(embed_scale_));
    auto x = torch::empty({B, hid}, opts), delta = torch::empty({B, hid}, opts), qkv = torch::empty({B, QKV}, opts);
    auto q = torch::empty({B, H, D}, opts), attn = torch::empty({B, H * D}, opts);
    auto gu = torch::empty({B, 2 * I}, opts), act = torch::empty({B, I}, opts);
    auto logits = torch::empty({S, V}, opts.dtype(at::kFloat));
    torch::Tensor head_out = std::is_same_v<T, float> ? logits : torch::empty({S, V}, opts);  // float32: straight to logits
    T *hp = h.data_ptr<T>(), *xp = x.data_ptr<T>(), *dp = delta.data_ptr<T>(), *qkvp = qkv.data_ptr<T>(),
      *qp = q.data_ptr<T>(), *ap = attn.data_ptr<T>(), *gup = gu.data_ptr<T>(), *actp = act.data_ptr<T>(),
      *lp = head_out.data_ptr<T>();
    float* logitsp = logits.data_ptr<float>();
    const T *cs0 = cs.data_ptr<T>(), *sn0 = sn.data_ptr<T>();
    const int64_t *slotp = slot.data_ptr<int64_t>(), *tp = tables.data_ptr<int64_t>(), *lenp = lens.data_ptr<int64_t>();
    const int64_t max_blocks = tables.size(1);
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_), cap = static_cast<float>(softcap_);
    std::vector<AttnItem> items = attn_items(lenp, B, KVH, group, tp, max_blocks);
    AttnPartials partials;
    partials.reset(lenp, B, H, D);
    SpinBarrier barrier;
    std::vector<size_t> item_begin;
    int64_t items_per_chunk = 1;  // group when each query head is an item of its own
    // Per (sequence, KV head): its items attended so far this step. The thread that attends the last of a layer
    // merges the group's query heads, so no barrier separates attending from merging.
    std::vector<std::atomic<int64_t>> attended(B * KVH);
    for (auto& a : attended) a.store(0, std::memory_order_relaxed);
    const bool own_rows = B * hid <= kOwnRowsElements;
#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp single
      {
        barrier.n = omp_get_num_threads();
        if (items.size() < kItemsPerThread * barrier.n && group > 1) {
          std::vector<AttnItem> heads;
          for (const AttnItem& it : items)
            for (int64_t g = 0; g < group; ++g) heads.push_back({it.b, it.kvh, it.chunk, g, g + 1, it.b_end});
          items = std::move(heads);
          items_per_chunk = group;
        }
        item_begin = split_items(items, lenp, barrier.n);
      }  // (the implicit barrier here publishes them)
      const int nt = barrier.n, t = omp_get_thread_num();
      Scratch s;
      s.quant.amx = amx_int8_;
      std::vector<T> normed(D);  // a q or k head after its norm
      std::vector<float> kv_row(kInt8Cache ? D : 0);  // a k or v row on its way into an int8 cache
      // h += add; x = RMSNorm(h) * w: a share of the rows each, or with few rows (own_rows) every row on every
      // thread, each into its own copy of h and x, with no barrier after.
      std::vector<T> own_h, own_x;
      T *hq = hp, *xq = xp;
      if (own_rows) {
        own_h.assign(hp, hp + B * hid);
        own_x.resize(B * hid);
        hq = own_h.data(), xq = own_x.data();
      }
      auto rows = [&](const torch::Tensor& w, const T* add) {
        for (int64_t m = own_rows ? 0 : t; m < B; m += own_rows ? 1 : nt)
          add_rms_norm_row(hq + m * hid, add ? add + m * hid : nullptr, w.data_ptr<T>(), xq + m * hid, hid, eps);
        if (!own_rows) barrier.wait();
      };
      auto out_norm = [&](const torch::Tensor& w) {  // delta = RMSNorm(delta) * w, a share of the rows each
        if (!w.defined()) return;
        for (int64_t m = t; m < B; m += nt) add_rms_norm_row(dp + m * hid, static_cast<const T*>(nullptr),
                                                             w.data_ptr<T>(), dp + m * hid, hid, eps);
        barrier.wait();
      };
      auto columns = [&](int64_t n) {  // this thread's share of n output columns (AMX: whole packed blocks)
        auto [n0, n1] = share(n, amx_ ? 32 : 16, t, nt);
        return std::make_pair(n0, t == nt - 1 ? n : n1);
      };
      auto matmul = [&](const Linear& L, const T* in, T* out) {
        const auto [n0, n1] = columns(L.N);
        linear_rows(L, in, L.K, B, out, L.N, n0, n1, amx_, s);
        barrier.wait();
      };
      for (size_t li = 0; li < layers_.size(); ++li) {
        const DecoderLayer& l = layers_[li];
        rows(l.input_norm, li ? dp : nullptr);
        auto* kc = l.k_cache.data_ptr<C>();
        auto* vc = l.v_cache.data_ptr<C>();
        float* ks = kInt8Cache ? l.k_scale.data_ptr<float>() : nullptr;
        float* vs = kInt8Cache ? l.v_scale.data_ptr<float>() : nullptr;
        matmul(l.qkv, xq, qkvp);
        for (int64_t i = t; i < B * (H + 2 * KVH); i += nt) {  // RoPE on q and k; k and v into their cache slots
          const int64_t m = i / (H + 2 * KVH), head = i % (H + 2 * KVH);
          const T* src = qkvp + m * QKV + head * D;
          const int64_t row = ropep[m] + l.rope_table * table_rows;
          const T *cp = cs0 + row * R, *sp = sn0 + row * R;
          if (head < H + KVH && l.q_norm.defined()) {  // the head's own RMSNorm first (Qwen3)
            const T* w = (head < H ? l.q_norm : l.k_norm).data_ptr<T>();
            add_rms_norm_row(const_cast<T*>(src), static_cast<const T*>(nullptr), w, normed.data(), D, eps);
            src = normed.data();
          }
          if (head < H) {
            rope_head(src, cp, sp, qp + (m * H + head) * D, D, R);
          } else if constexpr (kInt8Cache) {  // k after RoPE, or v, in T's values, then quantized with its scale
            const int64_t row = slotp[m] * KVH + (head < H + KVH ? head - H : head - H - KVH);
            if (head < H + KVH) rope_head(src, cp, sp, kv_row.data(), D, R);
            else std::transform(src, src + D, kv_row.data(), [](T v) { return static_cast<float>(v); });
            quantize_kv_row(kv_row.data(), D, (head < H + KVH ? kc : vc) + row * D, (head < H + KVH ? ks : vs) + row);
          } else if (head < H + KVH) {
            rope_head(src, cp, sp, kc + (slotp[m] * KVH + head - H) * D, D, R);
          } else {
            std::transform(src, src + D, vc + (slotp[m] * KVH + head - H - KVH) * D,
                           [](T v) { return static_cast<C>(static_cast<float>(v)); });
          }
        }
        barrier.wait();
        for (size_t i = item_begin[t]; i < item_begin[t + 1]; ++i) {
          const AttnItem& it = items[i];
          attend_chunk(it, qp, kc, vc, tp, lenp, H, KVH, D, max_blocks, block_size_, scale, partials, s.attn,
                       l.window, cap, ks, vs);
          // counts add up over the layers: a row's last item of this layer brings its count to (layer + 1) * items
          for (int64_t b = it.b; b < it.b_end; ++b) {
            const int64_t due = static_cast<int64_t>(li + 1) * attn_chunks(lenp[b]) * items_per_chunk;
            if (attended[b * KVH + it.kvh].fetch_add(1, std::memory_order_acq_rel) + 1 == due)
              for (int64_t h = it.kvh * group; h < (it.kvh + 1) * group; ++h)
                merge_chunks(b, h, lenp, ap, H, D, partials);
          }
        }
        barrier.wait();
        matmul(l.o, ap, dp);
        out_norm(l.attn_out_norm);
        rows(l.post_norm, dp);
        {  // this thread's gate rows j0..j1 and up rows I + j0..I + j1, then their SiLU * up: no barrier between
          const auto [j0, j1] = columns(I);
          q::QRows qx{};  // x quantized once for both
          linear_rows(l.gate_up, xq, hid, B, gup, 2 * I, j0, j1, amx_, s, qx);
          linear_rows(l.gate_up, xq, hid, B, gup, 2 * I, I + j0, I + j1, amx_, s, qx);
          for (int64_t m = 0; m < B; ++m)
            for (int64_t j = j0; j < j1; j += Vec::W)
              if (gelu_) gelu_tanh_mul(gup + m * 2 * I + j, gup + m * 2 * I + I + j, actp + m * I + j);
              else silu_mul(gup + m * 2 * I + j, gup + m * 2 * I + I + j, actp + m * I + j);
        }
        barrier.wait();
        matmul(l.down, actp, dp);
        out_norm(l.mlp_out_norm);
      }
      rows(final_norm_, layers_.empty() ? nullptr : dp);
      const auto [v0, v1] = columns(V);  // the LM head on the rows that sample, then this thread's logits as float32
      std::vector<T> picked;  // those rows, gathered (each thread its own copy: xq may be the thread's own)
      if (!every_row) {
        picked.resize(S * hid);
        for (int64_t i = 0; i < S; ++i) std::copy_n(xq + selp[i] * hid, hid, picked.data() + i * hid);
      }
      linear_rows(head_, every_row ? xq : picked.data(), head_.K, S, lp, V, v0, v1, amx_, s);
      if constexpr (!std::is_same_v<T, float>)
        for (int64_t m = 0; m < S; ++m)
          for (int64_t n = v0; n < v1; n += Vec::W) Vec::load(lp + m * V + n).store(logitsp + m * V + n);
      if (amx_) amx_release();
      if (amx_int8_) q::amx_int8_release();
    }
    return logits;
  }

 private:
  // A copy of every matmul's weights in the AMX layout, in the order a step reads them.
  void pack_all() {
    std::vector<Linear*> all;
    for (auto& l : layers_)
      for (Linear* L : {&l.qkv, &l.o, &l.gate_up, &l.down}) all.push_back(L);
    all.push_back(&head_);
    int64_t elements = 0;
    for (const Linear* L : all) elements += L->N * L->K;
    packed_ = std::make_unique<PackedBuffer>(elements);
    uint16_t* at = packed_->data;
    for (Linear* L : all) {
      pack_weight(reinterpret_cast<const uint16_t*>(L->parts[0].weight.data_ptr()), L->N, L->K, at);
      L->packed = at;
      at += L->N * L->K;
    }
  }

  std::unique_ptr<PackedBuffer> packed_;
  torch::Tensor embed_;
  int embed_qtype_;
  std::vector<DecoderLayer> layers_;
  torch::Tensor final_norm_;
  Linear head_;
  int64_t heads_, kv_heads_, dim_, hidden_ = 0;
  double eps_;
  int64_t block_size_;
  double scale_;
  double embed_scale_ = 1.0;
  double softcap_ = 0.0;
  int64_t rope_tables_ = 1;  // the step's cos and sin hold this many tables of equal rows, stacked
  bool gelu_ = false;
  bool amx_;
  bool amx_int8_;  // the tiled Q4_0 / Q4_1 / Q8_0 weights on AMX int8 tiles from 9 rows (qdot_lanes.h)

  static torch::Tensor checked_norm(const torch::Tensor& w, int64_t size) {
    TORCH_CHECK(w.scalar_type() == kType<T> && w.is_contiguous() && w.numel() == size,
                "LlamaDecoder: norm weights in the model dtype, of the size they normalize");
    return w;
  }
};

namespace {

template <typename T, typename C>
void bind_one(pybind11::module_& m, const char* name) {
  using release = py::call_guard<py::gil_scoped_release>;
  // module_local: each ISA level's build is its own module with the same C++ type, and a process may load several
  // (the tests load every level the CPU has); a global registration would refuse the second.
  py::class_<LlamaDecoder<T, C>>(m, name, py::module_local())
      .def(py::init<const torch::Tensor&, int64_t, const std::vector<std::vector<torch::Tensor>>&,
                    const std::vector<std::vector<torch::Tensor>>&, const std::vector<std::vector<int64_t>>&,
                    const std::vector<torch::Tensor>&, const torch::Tensor&, int64_t, int64_t, int64_t, double,
                    int64_t, double, bool>())
      .def("configure", &LlamaDecoder<T, C>::configure,
           "configure(qk_norms, out_norms, windows, rope_tables, embed_scale, residual_scale, logit_div, gelu, "
           "attn_softcap, final_softcap): the family's differences from Llama's block")
      .def("step", &LlamaDecoder<T, C>::step,
           "one step: step(ids, rope_rows, cos, sin, slots, block_tables, lengths, head_rows or None) -> float32 "
           "logits [len(head_rows) or B, vocab]",
           release());
}

}  // namespace

void bind_decoder(pybind11::module_& m) {
  bind_one<float, float>(m, "LlamaDecoder_float32");
  bind_one<bf16, bf16>(m, "LlamaDecoder_bfloat16");
  // the KV cache in float16 (`--kv-cache-dtype float16`): half the bytes a step's attention reads
  bind_one<float, f16>(m, "LlamaDecoder_float32_kv_float16");
  bind_one<bf16, f16>(m, "LlamaDecoder_bfloat16_kv_float16");
  // the KV cache in int8 with a scale per row (`--kv-cache-dtype int8`)
  bind_one<float, int8_t>(m, "LlamaDecoder_float32_kv_int8");
  bind_one<bf16, int8_t>(m, "LlamaDecoder_bfloat16_kv_int8");
}

}  // namespace peregrine
