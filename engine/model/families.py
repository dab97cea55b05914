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

Sliding-window layers are not served here (`window` says so: such a model keeps the generic path).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class Family:
    """How a family's block differs from Llama's."""

    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (self_attn.q_norm / k_norm)
    activation: str = "silu"  # the MLP's gate activation (config.hidden_act)
    fused: bool = False  # q/k/v and gate/up are one Linear each in the model (self_attn.qkv_proj, mlp.gate_up_proj)
    multipliers: bool = False  # Granite's embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm=True),
    "granite": Family(multipliers=True),
    "phi3": Family(fused=True),
}


@dataclass(frozen=True, slots=True)
class Block:
    """One model's numbers for its family's block."""

    family: Family
    head_dim: int
    attention_scale: float  # the softmax scale: head_dim ** -0.5, or Granite's attention_multiplier
    embedding_scale: float = 1.0  # the looked-up embeddings times this
    residual_scale: float = 1.0  # each block's output (o, down) times this before the residual add
    logit_divisor: float = 1.0  # the logits over this


def family_of(config: object) -> Family | None:
    """The family of a transformers config, or None when it is not one of the table's."""
    family = FAMILIES.get(str(getattr(config, "model_type", "")))
    if family is None or getattr(config, "hidden_act", "silu") != family.activation or sliding_window(config):
        return None
    return family


def block_of(config: object) -> Block:
    family = family_of(config)
    if family is None:
        raise ValueError(f"no fast-path family for model_type {getattr(config, 'model_type', None)!r}")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if not family.multipliers:
        return Block(family, head_dim, head_dim**-0.5)
    return Block(family, head_dim, float(config.attention_multiplier), float(config.embedding_multiplier),
                 float(config.residual_multiplier), float(config.logits_scaling))


def sliding_window(config: object) -> bool:
    """Whether any layer attends through a sliding window (left to the generic path)."""
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return True
    if hasattr(config, "use_sliding_window"):  # Qwen2/Qwen3 keep a window size even when it is off
        return bool(config.use_sliding_window) and getattr(config, "sliding_window", None) is not None
    return getattr(config, "sliding_window", None) is not None


def attn_linears(layer: nn.Module, family: Family) -> tuple[nn.Module, ...]:
    """The attention's projections: (q, k, v, o), or (qkv, o) for a fused family."""
    a = layer.self_attn
    return (a.qkv_proj, a.o_proj) if family.fused else (a.q_proj, a.k_proj, a.v_proj, a.o_proj)


def mlp_linears(layer: nn.Module, family: Family) -> tuple[nn.Module, ...]:
    """The MLP's projections: (gate, up, down), or (gate_up, down) for a fused family."""
    m = layer.mlp
    return (m.gate_up_proj, m.down_proj) if family.fused else (m.gate_proj, m.up_proj, m.down_proj)
