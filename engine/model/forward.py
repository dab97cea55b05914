"""A lean forward pass for the Llama-block families (engine/model/families.py: Llama, SmolLM, Mistral, Qwen2, Qwen3,
Granite, Phi-3, Gemma 2 and 3), on the model's own weights; what a family changes in the block comes from its row of
that table.

Same math as transformers' LlamaForCausalLM, with fewer, larger ops per layer: q/k/v and gate/up are fused
into one matmul each (the original nn.Linear weights become views into the fused tensors, so memory is not
doubled and the generic path keeps working), RoPE is applied to q and k in one go, the residual add and
RMSNorm are one call (`engine.backends.cpu_kernels`: a fused kernel in bfloat16 on CPU, torch ops otherwise) that takes
its statistics in float32 exactly as transformers does (torch's `F.rms_norm` in bfloat16 loses enough
precision to change SmolLM2's answers), and the final norm and LM head only run on the rows that sample.
Attention is the same paged attention as the generic path (`engine.model.attention.attend`). Chosen automatically when `supports(model)`.

Decode-only steps on CPU go further: `engine.backends.cpu_kernels`' LlamaDecoder runs the whole step (the embedding lookup,
all layers, the final norm and the LM head, the head on the rows that sample only) in one kernel call, built on the
first such step over the KV cache it writes to, in float32 or bfloat16, over dense weights or GGUF weights kept quantized (each projection handed over
as its parts: dense tensors or quantized blocks with their ggml type; int8 activations, `engine/backends/csrc/qdot.h`).
With quantized weights, prefill and mixed steps go through it too: each prompt token is a row like a decode, with
its sequence's block table and its position + 1 as its context (`step_rows`), so every token is computed by the
same instructions whatever its step holds, and a prompt gives the same bits whole, in chunks or after cached
blocks (docs/determinism.md). Prefill with dense weights, other dtypes and devices keep the op-by-op pass below
(torch's GEMM is much faster than the decoder's rows for dense prompts; it serves devices and dtypes the C++ step
does not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends import huge_pages
from engine.backends.kernels import TORCH, Kernels, Linear
from engine.model import quant
from engine.model.attention import AttentionMetadata, attend
from engine.model.families import Block, attn_linears, block_of, family_of, mlp_linears
from engine.model.kv_cache import KVCache
from engine.model.quant import QuantEmbedding, QuantLinear, QuantWeight, concat, is_quantized, stack_rows

log = logging.getLogger(__name__)

def supports(model: nn.Module) -> bool:
    """A family of engine/model/families.py (the Llama block and its variants) with dense nn.Linear or quantized
    projections; sliding-window layers only where the family's row has them (Gemma 2 and 3), else the generic path."""
    family = family_of(model.config)
    inner = getattr(model, "model", None)
    if family is None or inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return False
    try:
        linears = [m for layer in inner.layers for m in (*attn_linears(layer, family), *mlp_linears(layer, family))]
    except AttributeError:  # a model of that type built otherwise
        return False
    return all(type(m) in (nn.Linear, QuantLinear) for m in (*linears, model.lm_head))


# A projection's weight: dense, quantized (engine/model/quant.py), or a list of both kinds whose outputs are concatenated
# (projections quantized in different formats, as Q4_K_M files mix Q4_K and Q6_K, are not fused).
Weight = torch.Tensor | QuantWeight | list[torch.Tensor | QuantWeight]


def weight_of(m: nn.Module) -> torch.Tensor | QuantWeight:
    return m.qweight if isinstance(m, QuantLinear) else m.weight


def _fuse(linears: tuple[nn.Module, ...]) -> tuple[Weight, torch.Tensor | None]:
    """Concatenate the weights (and biases) along the output dim and re-point each Linear at its slice: dense
    weights, or quantized ones of one format; others stay a list."""
    has_bias = all(m.bias is not None for m in linears)
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
    if all(type(m) is nn.Linear for m in linears):
        weight: Weight = stack_rows([m.weight.detach() for m in linears])
    elif all(isinstance(m, QuantLinear) for m in linears):
        weight = concat([m.qweight for m in linears]) or [m.qweight for m in linears]
    else:
        weight = [weight_of(m) for m in linears]
    start = 0
    for m in linears:
        rows = m.out_features
        if isinstance(weight, torch.Tensor):
            m.weight.data = weight[start : start + rows]
        elif isinstance(weight, QuantWeight):  # the fused blocks are the only copy
            m.qweight = weight.slice_rows(start, start + rows)
            m.blocks = m.qweight.blocks
        if bias is not None:
            m.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


def _joined(linears: list[nn.Module]) -> tuple[Weight, torch.Tensor | None]:
    """One matmul of `linears` (fused here), or the model's own when it is one already (Phi-3's qkv_proj: q, k, v
    rows in that order; gate_up_proj: gate rows, then up rows)."""
    if len(linears) == 1:
        return weight_of(linears[0]), linears[0].bias
    return _fuse(tuple(linears))


def quant_aware(linear: Linear) -> Callable[[torch.Tensor, Weight, torch.Tensor | None], torch.Tensor]:
    """`linear` for dense weights; the quantized kernels for QuantWeight; a list runs piece by piece."""

    def call(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return linear(x, weight, bias)
        if isinstance(weight, QuantWeight):
            out = weight.matmul(x)
        else:
            out = torch.cat([call(x, w, None) for w in weight], dim=-1)
        return out if bias is None else out + bias

    return call


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [(heads + 2 * kv_heads) * dim, hidden]
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # [head_dim], per-head RMSNorm before RoPE (Qwen3)
    k_norm: torch.Tensor | None
    gate_up: Weight  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    attn_out_norm: torch.Tensor | None = None  # [hidden], o's output normalized before the residual add (Gemma 3)
    mlp_out_norm: torch.Tensor | None = None  # [hidden], down's likewise
    window: int = 0  # a sliding-window layer's window (0: none)
    layer_type: str | None = None  # its RoPE table (Gemma 3: "sliding_attention" or "full_attention")


class LlamaFastForward:
    def __init__(self, model: nn.Module, kernels: Kernels = TORCH) -> None:
        config = model.config
        self.model = model
        # torch's linear (engine.backends.kernels.linear_torch) or engine.backends.cpu_kernels' small-batch kernel; with quantized
        # weights, wrapped to route those to theirs
        self._quantized = is_quantized(model)
        self.linear = quant_aware(kernels.linear) if self._quantized else kernels.linear
        self.add_norm = kernels.add_rms_norm  # residual add + RMSNorm: torch ops, or engine.backends.cpu_kernels' fused one
        inner = model.model
        self.block: Block = block_of(config, inner.norm.weight.dtype)  # how this family's block differs from Llama's
        self.final_norm = _offset(inner.norm.weight, self.block.family.norm_offset)
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = self.block.head_dim
        self.eps = config.rms_norm_eps
        self.scaling = self.block.attention_scale
        self.layers = []
        for layer in inner.layers[: config.num_hidden_layers]:
            self.layers.append(self._layer(layer))
            huge_pages.release_freed_memory()  # its unfused copies, freed: glibc would keep them (the peak held both)
        self._decoder_factory = decoder = kernels.decoder  # cpu_kernels.llama_decoder_for: None unless on CPU
        self._decoder: tuple[KVCache, object] | None = None  # built on the first decode-only step
        quant.lay_out([w for w, _ in self._matmuls()], model, decoder is not None and kernels.tile_rows > 0)
        if decoder is not None:  # at start, not on the first request: the step's weights onto huge pages, in order
            huge_pages.gather([t for weight, _ in self._matmuls() for t in _parts(weight)[0]], self._weight_tensors())
        rope_type = str(getattr(inner.rotary_emb, "rope_type", "default"))
        # RoPE that depends on the position alone (not "dynamic" scaling, not longrope's length switch) is looked up
        # in a table for the decoder instead of being recomputed each step.
        self._static_rope = "dynamic" not in rope_type and rope_type != "longrope"
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def decoder(self, kv_cache: KVCache) -> object | None:
        """The one-call decode step over `kv_cache`, or None where it does not apply (logged once)."""
        if self._decoder_factory is None:
            return None
        if self._decoder is None or self._decoder[0] is not kv_cache:
            none = torch.empty(0)
            layers = [[w.input_norm, w.post_norm, kv_cache.k[i], kv_cache.v[i]] for i, w in enumerate(self.layers)]
            if kv_cache.quantized:  # int8 values: each layer's row scales after its caches
                layers = [[*t, kv_cache.k_scale[i], kv_cache.v_scale[i]] for i, t in enumerate(layers)]
            matmuls = self._matmuls()
            parts = [_parts(weight) for weight, _ in matmuls]
            embed = self.model.model.embed_tokens
            embed_weight, embed_type = _parts(embed.qweight if isinstance(embed, QuantEmbedding) else embed.weight)
            try:
                built = self._decoder_factory(embed_weight[0], embed_type[0], layers, [p[0] for p in parts],
                                              [p[1] for p in parts], [_or(bias, none) for _, bias in matmuls],
                                              self.final_norm, self.heads, self.kv_heads, self.head_dim,
                                              self.eps, kv_cache.block_size, self.scaling)
                self._configure(built)
            except RuntimeError as exc:  # a shape or dtype the kernel does not take: keep the op-by-op pass
                log.info("one-call decode step off: %s", str(exc).splitlines()[0])
                self._decoder_factory = None  # (the op-by-op pass multiplies tiled weights through packed copies)
                return None
            self._decoder = (kv_cache, built)
        return self._decoder[1]

    def _configure(self, built: object) -> None:
        """The decoder's view of the family's differences (LlamaDecoder::configure)."""
        b, types = self.block, self._rope_types()
        built.configure([n for w in self.layers if w.q_norm is not None for n in (w.q_norm, w.k_norm)],
                        [n for w in self.layers if w.attn_out_norm is not None for n in (w.attn_out_norm, w.mlp_out_norm)],
                        [w.window for w in self.layers], [types.index(w.layer_type) for w in self.layers],
                        b.embedding_scale, b.residual_scale, b.logit_divisor, b.family.activation != "silu",
                        b.attn_softcap, b.final_softcap)

    def _rope_types(self) -> list[str | None]:
        """The RoPE tables a step hands the decoder, stacked in this order: one per layer type (None: the one)."""
        return sorted({w.layer_type for w in self.layers}, key=str)

    def _whole_step(self, meta: AttentionMetadata) -> bool:
        """Whether the one-call step computes this step: decode steps always; prefill and mixed steps too with
        quantized weights, so that every token of every step, prompt or output, goes through the same
        instructions (the int8-activation matmuls, the paged attention in fixed chunks): a prompt's logits and KV
        are then the same bits whole, in chunks or after cached blocks, whatever its batch mates. Dense weights
        keep torch's GEMM for prompts (much faster there than the decoder's few-row kernels), but not for a step
        whose only chunks are speculative verifications (a few rows each: decode-like, and the same bits as
        the decodes they stand for)."""
        return not meta.prefills or self._quantized or all(chunk.verify for chunk in meta.prefills)

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every matmul's, the LM head's included (the embedding lookup reads
        a row per token, not counted)."""
        return sum(t.nbytes for weight, _ in self._matmuls() for t in _parts(weight)[0])

    def _matmuls(self) -> list[tuple[Weight, torch.Tensor | None]]:
        """Every matmul's (weight, bias) in the order a decode step runs them, the LM head last."""
        head = self.model.lm_head
        return [(weight, bias) for w in self.layers
                for weight, bias in ((w.qkv, w.qkv_bias), (w.o, w.o_bias), (w.gate_up, w.gate_up_bias),
                                     (w.down, w.down_bias))] + [(weight_of(head), head.bias)]

    def _weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor object that may view a weight: the model's parameters and buffers, the quantized modules'
        blocks, the fused weights of each layer."""
        found = [*self.model.parameters(), *self.model.buffers()]
        found += [m.qweight.blocks for m in self.model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
        for value in (getattr(w, f.name) for w in self.layers for f in fields(w)):
            for piece in value if isinstance(value, list) else [value]:
                if isinstance(piece, QuantWeight | torch.Tensor):
                    found.append(piece.blocks if isinstance(piece, QuantWeight) else piece)
        return found

    def decoder_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder's RoPE inputs: each token's row of (cos, sin) tables. Static RoPE: rows of a table of every
        position so far (the same values the rotary module gives, computed once). Else this step's own rows."""
        if not self._static_rope:
            cos, sin = self._rope_tables(positions)
            return torch.arange(positions.shape[0], device=positions.device), cos, sin
        need = int(positions.numpy().max()) + 1  # the decoder runs on CPU; numpy skips a torch dispatch
        if self._rope_table is None or self._rope_table[0].shape[0] < need * len(self._rope_types()):
            rows = max(256, 1 << (need - 1).bit_length())  # doubling: a handful of rebuilds over a long sequence
            cos, sin = self._rope_tables(torch.arange(rows, device=positions.device))
            self._rope_table = (cos.contiguous(), sin.contiguous())
        return positions, *self._rope_table

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer type's (cos, sin) rows of `positions`, the tables stacked in `_rope_types` order."""
        tables = [self._rope_rows(positions, t) for t in self._rope_types()]
        return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])

    def _rope_rows(self, positions: torch.Tensor, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's (cos, sin) rows of `positions` (of `layer_type`'s RoPE), in the model dtype."""
        probe = torch.empty(0, dtype=self.model.model.norm.weight.dtype, device=positions.device)  # the model dtype
        rotary = self.model.model.rotary_emb
        cos, sin = rotary(probe, positions[None]) if layer_type is None else rotary(probe, positions[None], layer_type)
        return cos[0], sin[0]

    def _layer(self, layer: nn.Module) -> LayerWeights:
        family = self.block.family
        *qkv_parts, o = attn_linears(layer, family)
        *gate_up_parts, down = mlp_linears(layer, family)
        qkv, qkv_bias = _joined(qkv_parts)
        gate_up, gate_up_bias = _joined(gate_up_parts)
        a, b = layer.self_attn, self.block

        def norm(module: nn.Module | None) -> torch.Tensor | None:
            return None if module is None else _offset(module.weight, family.norm_offset)

        q_norm, k_norm = (norm(a.q_norm), norm(a.k_norm)) if family.qk_norm else (None, None)
        # Gemma 3: post_attention_layernorm is o's output norm, pre_feedforward_layernorm the MLP's input norm
        post, sandwich = layer.post_attention_layernorm, family.sandwich
        index = int(getattr(a, "layer_idx", 0))
        return LayerWeights(
            norm(layer.input_layernorm), qkv, qkv_bias, weight_of(o), o.bias,
            norm(layer.pre_feedforward_layernorm if sandwich else post), q_norm, k_norm, gate_up, gate_up_bias,
            weight_of(down), down.bias, norm(post if sandwich else None),
            norm(layer.post_feedforward_layernorm if sandwich else None),
            b.windows[index] if b.windows else 0, b.layer_types[index] if b.layer_types else None,
        )

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [tokens]. Returns logits [len(logits_indices), vocab]: in the model dtype op by op,
        float32 (holding the model dtype's values) from the one-call decode step."""
        inner = self.model.model
        decoder = self.decoder(meta.kv_cache) if self._whole_step(meta) else None
        if decoder is not None:
            tables, lengths = step_rows(meta, positions)
            return decoder.step(input_ids, *self.decoder_rope(positions), meta.slot_mapping, tables, lengths,
                                logits_indices)  # the LM head runs on those rows only
        family = self.block.family  # Gemma's embedding module scales its rows itself; Granite's model does it
        h = inner.embed_tokens(input_ids)  # [tokens, hidden], the residual stream, updated in place
        h = h if family.scaled_embedding else self._scaled(h, self.block.embedding_scale)
        ropes = {t: self._rope_rows(positions, t) for t in self._rope_types()}  # [tokens, rotary dims] each
        delta = None  # the last block's output, not yet added to h
        for index, w in enumerate(self.layers):
            cos, sin = (r[:, None, :] for r in ropes[w.layer_type])  # [tokens, 1, rotary dims]
            x = self.add_norm(h, delta, w.input_norm, self.eps)
            x = self.add_norm(h, self._output(self._attention(index, w, x, cos, sin, meta), w.attn_out_norm),
                              w.post_norm, self.eps)
            delta = self._output(self._mlp(w, x), w.mlp_out_norm)
        rows = h[logits_indices]  # the final norm and the LM head only run on the rows that sample
        last = self.add_norm(rows, None if delta is None else delta[logits_indices], self.final_norm, self.eps)
        head = self.model.lm_head
        logits = self.linear(last, weight_of(head), head.bias)
        return self._capped(logits if self.block.logit_divisor == 1.0 else logits / self.block.logit_divisor)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits soft-capped (Gemma 2: cap * tanh(x / cap), in their own dtype as transformers does; the
        one-call step caps its own)."""
        cap = self.block.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    @staticmethod
    def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x if scale == 1.0 else x * scale

    def _output(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """A block's output as the residual add takes it: normalized (Gemma 3), scaled (Granite)."""
        out = out if norm is None else self.add_norm(out, None, norm, self.eps)
        return self._scaled(out, self.block.residual_scale)

    def _attention(self, index: int, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.linear(x, w.qkv, w.qkv_bias).view(tokens, self.heads + 2 * self.kv_heads, self.head_dim)
        qk = qkv[:, : self.heads + self.kv_heads]  # [tokens, heads + kv_heads, dim]
        if w.q_norm is not None:  # each head's own RMSNorm before RoPE (Qwen3)
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
            qk = torch.cat((_head_norm(q, w.q_norm, self.eps), _head_norm(k, w.k_norm, self.eps)), dim=1)
        qk = _rope(qk, cos, sin)
        q, k = qk.split((self.heads, self.kv_heads), dim=1)
        v = qkv[:, self.heads + self.kv_heads :]
        out = attend(index, q, k, v, meta, self.scaling, w.window, self.block.attn_softcap)  # [tokens, heads, dim]
        return self.linear(out.reshape(tokens, -1), w.o, w.o_bias)

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        act = F.silu(gate) if self.block.family.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.linear(act * up, w.down, w.down_bias)


def step_rows(meta: AttentionMetadata, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-call step's block table and context length of every token of the step: a decode's own, and each
    prompt token its sequence's blocks up to the chunk's end and its position + 1 (it attends to the tokens before
    it, those of its own chunk included, exactly as a decode at that position would)."""
    if not meta.prefills:
        return meta.decode_block_tables, meta.decode_lengths
    parts = [] if not meta.num_decodes else [meta.decode_block_tables]
    parts += [chunk.context_blocks[None].expand(chunk.length, -1) for chunk in meta.prefills]
    width = max(p.shape[1] for p in parts)
    null = meta.kv_cache.null_block
    tables = torch.cat([F.pad(p, (0, width - p.shape[1]), value=null) for p in parts])
    return tables, positions + 1


def _parts(weight: Weight) -> tuple[list[torch.Tensor], list[int]]:
    """The decoder's view of a weight: its pieces (dense tensors or quantized blocks) and their ggml types (0: dense)."""
    pieces = weight if isinstance(weight, list) else [weight]
    return ([p.blocks if isinstance(p, QuantWeight) else p for p in pieces],
            [p.qtype if isinstance(p, QuantWeight) else 0 for p in pieces])


def _or(tensor: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if tensor is None else tensor


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' rotate-half convention, on the first cos.shape[-1] dims (all but for a
    partial rotary: Phi-4-mini). x: [tokens, heads, dim]."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _offset(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """An RMSNorm weight as the norm uses it: w, or offset + w computed in float32 (Gemma's 1 + w)."""
    return weight if offset == 0.0 else (offset + weight.float()).to(weight.dtype)


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's dims, transformers' rounding (statistics in float32). x: [tokens, heads, dim]."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
