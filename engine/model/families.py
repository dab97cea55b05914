"""The model families the lean forward (engine/model/forward.py) and the one-call decoder serve, each described by how
its block differs from Llama's: a small table, read by both, instead of a forward per family.

The Llama block: RMSNorm, then q/k/v (biases allowed: Qwen2), RoPE on q and k (the model's own rotary module gives
cos and sin, so Llama 3.x rope scaling and its inv_freq come with it), attention scaled by head_dim ** -0.5, o, a
residual add, RMSNorm, gate/up, SiLU(gate) * up, down, a residual add; the final norm and the LM head.

| family  | q/k norm | activation | fused tensors        | multipliers                                   | rotary  |
|---------|----------|------------|----------------------|-----------------------------------------------|---------|
| llama   | -        | silu       | -                    | -                                             | full    |
| mistral | -        | silu       | -                    | -                                             | full    |
| qwen2   | -        | silu       | -                    | -                                             | full    |
| qwen3   | per head | silu       | -                    | -                                             | full    |
| granite | -        | silu       | -                    | embedding, residual, attention scale, logits  | full    |
| phi3    | -        | silu       | qkv_proj, gate_up    | -                                             | partial |
| gemma2  | -        | gelu_tanh  | -                    | embeddings * sqrt(hidden) (in the embedding)  | full    |
| gemma3  | per head | gelu_tanh  | -                    | embeddings * sqrt(hidden) (in the embedding)  | 2 bases |

Gemma 2 and 3 also: norm weights used as 1 + w, an RMSNorm on each block's output before the residual add
(post-attention, post-feed-forward), attention scaled by query_pre_attn_scalar ** -0.5, and sliding-window layers
(Gemma 2: every other one; Gemma 3: 5 of 6, whose RoPE has its own base). Gemma 2 soft-caps the attention scores
and the logits: x -> cap * tanh(x / cap) (`attn_logit_softcapping`, `final_logit_softcapping`). Other families with
a sliding window keep the generic path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class Family:
    """How a family's block differs from Llama's."""

    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (self_attn.q_norm / k_norm)
    activation: str = "silu"  # the MLP's gate activation (config.hidden_act)
    fused: bool = False  # q/k/v and gate/up are one Linear each in the model (self_attn.qkv_proj, mlp.gate_up_proj)
    multipliers: bool = False  # Granite's embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling
    norm_offset: float = 0.0  # RMSNorm weights used as offset + w (Gemma: 1)
    sandwich: bool = False  # o's and down's outputs normalized before the residual add (Gemma 3's post norms)
    scaled_embedding: bool = False  # the embedding module scales its rows by sqrt(hidden) (Gemma)
    sliding: bool = False  # some layers attend through a sliding window
    typed_rope: bool = False  # each layer type has its own RoPE table (Gemma 3's rotary module takes the layer type)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm=True),
    "granite": Family(multipliers=True),
    "phi3": Family(fused=True),
    "gemma2": Family(activation="gelu_pytorch_tanh", norm_offset=1.0, sandwich=True, scaled_embedding=True,
                     sliding=True),
    "gemma3_text": Family(qk_norm=True, activation="gelu_pytorch_tanh", norm_offset=1.0, sandwich=True,
                          scaled_embedding=True, sliding=True, typed_rope=True),
}


@dataclass(frozen=True, slots=True)
class Block:
    """One model's numbers for its family's block."""

    family: Family
    head_dim: int
    attention_scale: float  # the softmax scale: head_dim ** -0.5, or Granite's attention_multiplier
    embedding_scale: float = 1.0  # the looked-up rows times this (in the decoder; op by op, Granite's only)
    residual_scale: float = 1.0  # each block's output (o, down) times this before the residual add
    logit_divisor: float = 1.0  # the logits over this
    layer_types: tuple[str, ...] = ()  # per layer its type (RoPE table), for a family with typed_rope
    windows: tuple[int, ...] = ()  # per layer its window (0: none), for a sliding family
    attn_softcap: float = 0.0  # attention scores x -> cap * tanh(x / cap) before the softmax (Gemma 2; 0: none)
    final_softcap: float = 0.0  # the logits likewise, after the LM head (Gemma 2; 0: none)


def family_of(config: object) -> Family | None:
    """The family of a transformers config, or None when it is not one of the table's."""
    family = FAMILIES.get(str(getattr(config, "model_type", "")))
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if family is None or activation != family.activation or (sliding_window(config) and not family.sliding):
        return None
    return family


def block_of(config: object, dtype: torch.dtype = torch.float32) -> Block:
    """The numbers of `config`'s block, for a model in `dtype`."""
    family = family_of(config)
    if family is None:
        raise ValueError(f"no fast-path family for model_type {getattr(config, 'model_type', None)!r}")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if family.multipliers:
        return Block(family, head_dim, float(config.attention_multiplier), float(config.embedding_multiplier),
                     float(config.residual_multiplier), float(config.logits_scaling))
    if not family.sliding:
        return Block(family, head_dim, head_dim**-0.5)
    types = tuple(config.layer_types[: config.num_hidden_layers]) if family.typed_rope else ()
    scale = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))  # Gemma rounds it to the model dtype
    attn_cap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
    final_cap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
    return Block(family, head_dim, float(config.query_pre_attn_scalar) ** -0.5, scale, layer_types=types,
                 windows=layer_windows(config), attn_softcap=attn_cap, final_softcap=final_cap)


def sliding_window(config: object) -> bool:
    """Whether any layer attends through a sliding window (left to the generic path)."""
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return True
    if hasattr(config, "use_sliding_window"):  # Qwen2/Qwen3 keep a window size even when it is off
        return bool(config.use_sliding_window) and getattr(config, "sliding_window", None) is not None
    return getattr(config, "sliding_window", None) is not None


def layer_windows(config: object) -> tuple[int, ...]:
    """Each layer's attention window, as the model's own attention applies it (0: the whole context): the
    `sliding_attention` layers of `layer_types` where the config has them, else every layer when the config turns a
    window on (Mistral). The KV cache gives back what lies behind them (engine/model/kv_cache.py)."""
    layers = int(config.num_hidden_layers)
    size = int(getattr(config, "sliding_window", None) or 0)
    if not size or not sliding_window(config):
        return (0,) * layers
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(size if t == "sliding_attention" else 0 for t in types[:layers])
    return (size,) * layers


def attn_linears(layer: nn.Module, family: Family) -> tuple[nn.Module, ...]:
    """The attention's projections: (q, k, v, o), or (qkv, o) for a fused family."""
    a = layer.self_attn
    return (a.qkv_proj, a.o_proj) if family.fused else (a.q_proj, a.k_proj, a.v_proj, a.o_proj)


def mlp_linears(layer: nn.Module, family: Family) -> tuple[nn.Module, ...]:
    """The MLP's projections: (gate, up, down), or (gate_up, down) for a fused family."""
    m = layer.mlp
    return (m.gate_up_proj, m.down_proj) if family.fused else (m.gate_proj, m.up_proj, m.down_proj)
