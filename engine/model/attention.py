"""Paged attention for any Hugging Face model that routes attention through `AttentionInterface`.

The model runs on one packed row of tokens from all scheduled sequences (`[1, total_tokens]`): single-token
items (decodes) first, then multi-token prefill chunks. For each layer, `paged_attention` writes the new K/V
into the cache slots of their positions, then attends:
- decodes: batched; on CPU with Peregrine's kernels (`engine.backends.cpu_kernels`) read straight from the cache
  through the block tables, otherwise over each sequence's cached context gathered into a padded
  [batch, kv_heads, ctx, dim] tensor with a length mask;
- prefill chunks: one SDPA per chunk, causal with the chunk's offset into its sequence.
The step's metadata (slots, gather indices, masks) is built once per step and shared by all layers; it reaches
this function as the `peregrine` keyword argument that transformers forwards from `model(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.backends.kernels import DecodeAttention
from engine.model.kv_cache import KVCache, dequantize_kv, quantize_kv

ATTN_IMPL = "peregrine_paged"
KERNEL_Q = (torch.float32, torch.bfloat16)  # the decode kernel's q dtypes; its caches: q's dtype or float16


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    offset: int  # first index of the chunk in the packed token row
    length: int  # tokens in the chunk
    start: int  # position of the chunk's first token in its sequence
    context_blocks: torch.Tensor  # [ceil((start + length) / block_size)] block ids of the sequence's context
    verify: bool = False  # a decode's last token and its speculative proposals (engine/core/speculative.py)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [total_tokens] long: where each new token's K/V goes
    num_decodes: int  # the first num_decodes tokens are single-token items
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long, padded with the null block
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: tuple[PrefillChunk, ...]
    decode_lengths: torch.Tensor | None = None  # [num_decodes] long: context tokens, this step's included
    # engine.backends.cpu_kernels' paged decode attention; None: gather + masked SDPA (then decode_mask is set)
    decode_kernel: DecodeAttention | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, total_tokens, dim]
    key: torch.Tensor,  # [1, kv_heads, total_tokens, dim]
    value: torch.Tensor,  # [1, kv_heads, total_tokens, dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    peregrine: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Returns ([1, total_tokens, heads, dim], None), the shape transformers' attention modules expect. A layer the
    model gives a `sliding_window` attends to its last that many positions, as transformers' mask would; a
    `softcap` (Gemma 2) caps its scores as transformers' eager attention does; `s_aux` (gpt-oss's attention sinks, a
    logit per head) joins each softmax's denominator, as its eager attention does."""
    if peregrine is None:
        raise RuntimeError("peregrine_paged attention needs the step metadata (model(..., peregrine=meta))")
    sinks = kwargs.get("s_aux")
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 peregrine, scaling, int(kwargs.get("sliding_window") or 0), float(kwargs.get("softcap") or 0.0),
                 sinks if isinstance(sinks, torch.Tensor) else None, attention_chunk(module))
    return out.unsqueeze(0), None


def attention_chunk(module: torch.nn.Module) -> int:
    """The chunk a layer attends within (Llama 4's chunked layers: position p sees the positions from
    p // chunk * chunk to p; transformers gives it by the mask only), else 0."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or ()
    index = getattr(module, "layer_idx", None)
    if not chunk or index is None or index >= len(types) or types[index] != "chunked_attention":
        return 0
    return int(chunk)


ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}  # config.layer_types


class UnsupportedModel(ValueError):
    """A model whose attention the paged KV cache cannot serve. The message is for the user."""


def check_supported(model: torch.nn.Module) -> None:
    """Raise UnsupportedModel for a model the paged attention would serve wrongly (`refusal`). A compiled model
    (torch.compile's wrapper: the Tenstorrent backend) is judged by the model it wraps."""
    model = getattr(model, "_orig_mod", model)
    message = refusal(type(model), getattr(model, "config", None))
    if message is not None:
        raise UnsupportedModel(message)


def refusal(model_class: type, config: object) -> str | None:
    """Why the paged attention cannot serve `model_class` with `config` (None: it can): one that computes attention
    itself instead of through transformers' AttentionInterface (it would attend to each step's own tokens only, so
    every token after the first would be wrong: Falcon, StableLM), layers that carry a state from step to step
    (Mamba, recurrent, convolution or linear-attention layers: the cache holds keys and values only), or multi-head
    latent attention (DeepSeek V2/V3: its keys and values differ in size from the heads the cache is laid out for)."""
    name = model_class.__name__
    text = getattr(config, "text_config", None) or config
    kinds = {str(k) for k in getattr(text, "layer_types", None) or ()} - ATTENTION_LAYERS
    if getattr(model_class, "_is_stateful", False) or kinds:
        layers = f" ({', '.join(sorted(kinds))} layers)" if kinds else ""
        return (f"{name} carries a state from step to step{layers}, which Peregrine's paged KV cache does not hold "
                "(keys and values only): this architecture cannot be served")
    if not getattr(model_class, "_supports_attention_backend", False):
        return (f"{name} computes attention itself, not through transformers' attention interface, which "
                "Peregrine's paged KV cache needs: this architecture cannot be served")
    if getattr(config, "kv_lora_rank", None):
        return (f"{name} uses multi-head latent attention (kv_lora_rank), whose keys and values the paged KV cache "
                "does not hold: this architecture cannot be served")
    return None


def config_refusal(config: dict[str, object]) -> str | None:
    """`refusal` from a config.json alone, before anything is downloaded; None also where transformers does not
    know the model type (remote code: the load decides)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        parsed = AutoConfig.for_model(str(config.get("model_type")), **fields)
        model_class = AutoModelForCausalLM._model_mapping[type(parsed)]
    except Exception:  # noqa: BLE001 - a config transformers cannot read here: the load decides
        return None
    return refusal(model_class, parsed)


class LayerCache(NamedTuple):
    """One layer's K and V caches [slots, kv_heads, dim], and an int8 cache's row scales [slots, kv_heads] (None
    for the float dtypes)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, cache: KVCache, layer: int) -> LayerCache:
        if cache.quantized:
            return cls(cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer])
        return cls(cache.k[layer], cache.v[layer])

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's keys and values into their slots, as the cache keeps them."""
        if self.k_scale is None or self.v_scale is None:
            self.k.index_copy_(0, slots, k.to(self.k.dtype))
            self.v.index_copy_(0, slots, v.to(self.v.dtype))
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, row_scales = quantize_kv(x)
            cache.index_copy_(0, slots, values)
            scales.index_copy_(0, slots, row_scales)

    def kept(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [..., dim] as the cache keeps it (rounded to its dtype; an int8 cache's: quantized and back)."""
        return dequantize_kv(*quantize_kv(x)) if self.k_scale is not None else x.to(self.k.dtype)

    def gather(self, block_tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of the blocks in `block_tables` [batch, blocks]: [batch, blocks * block_size, kv_heads,
        dim] each, in the cache's dtype (an int8 cache's: float32)."""
        keys, values = gather_blocks(self.k, block_tables, block_size), gather_blocks(self.v, block_tables, block_size)
        if self.k_scale is None or self.v_scale is None:
            return keys, values
        return (dequantize_kv(keys, gather_blocks(self.k_scale, block_tables, block_size)),
                dequantize_kv(values, gather_blocks(self.v_scale, block_tables, block_size)))


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
           scaling: float | None, window: int = 0, softcap: float = 0.0,
           sinks: torch.Tensor | None = None, chunk_size: int = 0) -> torch.Tensor:
    """Store this step's K/V of `layer` and attend. q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]. A
    sliding-window layer (`window` > 0: each token sees its last `window` positions), a chunked one (`chunk_size`:
    each token sees its own chunk's positions up to itself, Llama 4), soft-capped scores (`softcap` > 0: cap *
    tanh(score / cap), Gemma 2) and attention sinks (`sinks` [heads]: a logit each softmax takes beside the scores
    and drops, gpt-oss) take the row-by-row path.

    Returns [tokens, heads, dim]."""
    cache = LayerCache.of(meta.kv_cache, layer)
    cache.store(meta.slot_mapping, k, v)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    # every token as a row of its own: windows, CPU without the kernel, soft caps (SDPA has none) unless the kernel
    # takes the step (decodes only)
    capped_sdpa = softcap and (meta.prefills or not _kernel_takes(q, cache, meta))
    own_rows = window or chunk_size or sinks is not None or capped_sdpa
    if own_rows or (meta.decode_kernel is None and q.device.type == "cpu"):
        return _rows(q, cache, meta, scale, window, softcap, sinks, chunk_size)
    if not meta.prefills:
        return _decode(q, cache, meta, scaling, softcap)
    if not meta.num_decodes and len(meta.prefills) == 1:
        return _prefill(q, k, v, cache, meta.prefills[0], meta.kv_cache.block_size, scaling)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], cache, meta, scaling)
    for chunk in meta.prefills:
        span = slice(chunk.offset, chunk.offset + chunk.length)
        out[span] = _prefill(q[span], k[span], v[span], cache, chunk, meta.kv_cache.block_size, scaling)
    return out


def _kernel_takes(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> bool:
    return meta.decode_kernel is not None and q.dtype in KERNEL_Q and cache.k.dtype in (q.dtype, torch.float16)


def _decode(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scaling: float | None,
            softcap: float = 0.0) -> torch.Tensor:
    if _kernel_takes(q, cache, meta):
        return meta.decode_kernel(q.contiguous(), cache.k, cache.v, meta.decode_block_tables, meta.decode_lengths,
                                  meta.kv_cache.block_size, q.shape[-1] ** -0.5 if scaling is None else scaling,
                                  softcap)
    keys, values = cache.gather(meta.decode_block_tables, meta.kv_cache.block_size)
    # keys, values: [batch, max_blocks * block_size, kv_heads, dim]
    out = F.scaled_dot_product_attention(  # caches in another dtype (--kv-cache-dtype): widened to q's
        q.unsqueeze(2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
        attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True,
    )  # [batch, heads, 1, dim]
    return out.squeeze(2)


def _rows(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float, window: int = 0,
          softcap: float = 0.0, sinks: torch.Tensor | None = None, chunk_size: int = 0) -> torch.Tensor:
    """Each token, decode or prompt, attends alone over its sequence's cached context (this step's keys included:
    they are stored first), by ops whose shapes depend on that token's context length only, so its result does not
    depend on its batch mates, on how its prompt was chunked or on which blocks came from the prefix cache (the
    one-call step's guarantee, docs/determinism.md, for the op-by-op pass: CPU kernels off or at the `none`
    level). A Python loop over tokens: slower than one SDPA per chunk, the price of that guarantee there."""
    rows: list[tuple[int, torch.Tensor, int]] = []
    if meta.num_decodes:
        lengths = meta.decode_lengths.tolist()
        rows += [(i, meta.decode_block_tables[i], lengths[i]) for i in range(meta.num_decodes)]
    for chunk in meta.prefills:
        rows += [(chunk.offset + j, chunk.context_blocks, chunk.start + j + 1) for j in range(chunk.length)]
    out = torch.empty_like(q)
    for i, table, length in rows:
        out[i] = _row(q[i], cache, table, length, meta.kv_cache.block_size, scale, window, softcap, sinks,
                      chunk_size)
    return out


def _row(q: torch.Tensor, cache: LayerCache, table: torch.Tensor, length: int, block_size: int, scale: float,
         window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
         chunk_size: int = 0) -> torch.Tensor:
    """q [heads, dim] over the first `length` positions of the blocks in `table` (the last `window` of them when
    given, those of the last position's chunk when `chunk_size` is given): softmax in float32, over the scores
    soft-capped when `softcap` is given, and the heads' `sinks`."""
    blocks = table[None, : -(-length // block_size)]
    first = max(length - window, 0) if window else 0
    if chunk_size:
        first = max(first, (length - 1) // chunk_size * chunk_size)
    keys, values = cache.gather(blocks, block_size)
    keys = keys[0, first:length].float()  # [length - first, kv_heads, dim]
    values = values[0, first:length].float()
    group = q.shape[0] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = (keys * q.float()).sum(-1) * scale  # [length, heads]
    scores = torch.tanh(scores / softcap) * softcap if softcap else scores
    if sinks is None:
        probs = torch.softmax(scores, dim=0)
    else:
        probs = torch.softmax(torch.cat([scores, sinks.float()[None, :]]), dim=0)[:-1]
    return (probs[:, :, None] * values).sum(0).to(q.dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache: [slots, kv_heads, dim]; block_tables: [batch, blocks] -> [batch, blocks * block_size, kv_heads, dim]."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])[block_tables]  # [batch, blocks, block_size, h, d]
    return blocks.flatten(1, 2)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, chunk: PrefillChunk,
             block_size: int, scaling: float | None) -> torch.Tensor:
    query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, dim]
    if chunk.start == 0:  # this chunk's own keys and values, rounded as the cache holds them
        keys, values, mask = cache.kept(k), cache.kept(v), None
    else:
        end = chunk.start + chunk.length
        keys, values = cache.gather(chunk.context_blocks[None], block_size)
        keys, values = keys[0, :end], values[0, :end]  # [end, kv_heads, dim]
        mask = causal_mask(chunk.length, chunk.start, q.device)
    out = F.scaled_dot_product_attention(
        query, keys.transpose(0, 1).unsqueeze(0).to(q.dtype), values.transpose(0, 1).unsqueeze(0).to(q.dtype),
        attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True,
    )  # [1, heads, chunk, dim]
    return out[0].transpose(0, 1)


def causal_mask(length: int, start: int, device: torch.device) -> torch.Tensor:
    """[length, start + length] bool: query i (at position start + i) sees keys 0 .. start + i."""
    rows = torch.arange(length, device=device)[:, None] + start
    cols = torch.arange(start + length, device=device)[None, :]
    return cols <= rows


def register() -> None:
    """Make `ATTN_IMPL` a valid `attn_implementation` for transformers models (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, paged_attention)
