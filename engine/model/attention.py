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

import torch
import torch.nn.functional as F

from engine.backends.kernels import DecodeAttention
from engine.model.kv_cache import KVCache

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
    `softcap` (Gemma 2) caps its scores as transformers' eager attention does."""
    if peregrine is None:
        raise RuntimeError("peregrine_paged attention needs the step metadata (model(..., peregrine=meta))")
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 peregrine, scaling, int(kwargs.get("sliding_window") or 0), float(kwargs.get("softcap") or 0.0))
    return out.unsqueeze(0), None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
           scaling: float | None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Store this step's K/V of `layer` and attend. q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]. A
    sliding-window layer (`window` > 0: each token sees its last `window` positions) and soft-capped scores
    (`softcap` > 0: cap * tanh(score / cap), Gemma 2) take the row-by-row path.

    Returns [tokens, heads, dim]."""
    k_cache, v_cache = meta.kv_cache.k[layer], meta.kv_cache.v[layer]
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    # every token as a row of its own: windows, CPU without the kernel, soft caps (SDPA has none) unless the kernel
    # takes the step (decodes only)
    capped_sdpa = softcap and (meta.prefills or not _kernel_takes(q, k_cache, meta))
    if window or (meta.decode_kernel is None and q.device.type == "cpu") or capped_sdpa:
        return _rows(q, k_cache, v_cache, meta, scale, window, softcap)
    if not meta.prefills:
        return _decode(q, k_cache, v_cache, meta, scaling, softcap)
    if not meta.num_decodes and len(meta.prefills) == 1:
        return _prefill(q, k, v, k_cache, v_cache, meta.prefills[0], meta.kv_cache.block_size, scaling)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], k_cache, v_cache, meta, scaling)
    for chunk in meta.prefills:
        span = slice(chunk.offset, chunk.offset + chunk.length)
        out[span] = _prefill(q[span], k[span], v[span], k_cache, v_cache, chunk, meta.kv_cache.block_size, scaling)
    return out


def _kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    return meta.decode_kernel is not None and q.dtype in KERNEL_Q and k_cache.dtype in (q.dtype, torch.float16)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            scaling: float | None, softcap: float = 0.0) -> torch.Tensor:
    if _kernel_takes(q, k_cache, meta):
        return meta.decode_kernel(q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_lengths,
                                  meta.kv_cache.block_size, q.shape[-1] ** -0.5 if scaling is None else scaling,
                                  softcap)
    keys = gather_blocks(k_cache, meta.decode_block_tables, meta.kv_cache.block_size).transpose(1, 2)
    values = gather_blocks(v_cache, meta.decode_block_tables, meta.kv_cache.block_size).transpose(1, 2)
    # keys, values: [batch, kv_heads, max_blocks * block_size, dim]
    out = F.scaled_dot_product_attention(  # caches in another dtype (--kv-cache-dtype): widened to q's
        q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.decode_mask, scale=scaling,
        enable_gqa=True,
    )  # [batch, heads, 1, dim]
    return out.squeeze(2)


def _rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
          scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
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
        out[i] = _row(q[i], k_cache, v_cache, table, length, meta.kv_cache.block_size, scale, window, softcap)
    return out


def _row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int,
         block_size: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [heads, dim] over the first `length` positions of the blocks in `table` (the last `window` of them when
    given): softmax in float32, over the scores soft-capped when `softcap` is given."""
    blocks = table[None, : -(-length // block_size)]
    first = max(0, length - window) if window else 0
    keys = gather_blocks(k_cache, blocks, block_size)[0, first:length].float()  # [length - first, kv_heads, dim]
    values = gather_blocks(v_cache, blocks, block_size)[0, first:length].float()
    group = q.shape[0] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = (keys * q.float()).sum(-1) * scale  # [length, heads]
    probs = torch.softmax(torch.tanh(scores / softcap) * softcap if softcap else scores, dim=0)
    return (probs[:, :, None] * values).sum(0).to(q.dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache: [slots, kv_heads, dim]; block_tables: [batch, blocks] -> [batch, blocks * block_size, kv_heads, dim]."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])[block_tables]  # [batch, blocks, block_size, h, d]
    return blocks.flatten(1, 2)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             chunk: PrefillChunk, block_size: int, scaling: float | None) -> torch.Tensor:
    query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, dim]
    if chunk.start == 0:  # this chunk's own keys and values, rounded as the cache holds them
        keys, values, mask = k.to(k_cache.dtype), v.to(k_cache.dtype), None
    else:
        end = chunk.start + chunk.length
        keys = gather_blocks(k_cache, chunk.context_blocks[None], block_size)[0, :end]  # [end, kv_heads, dim]
        values = gather_blocks(v_cache, chunk.context_blocks[None], block_size)[0, :end]
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
