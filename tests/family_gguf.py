"""Tiny random-weight models of each family served quantized (engine/model/families.py), written as GGUF files the way
llama.cpp's converter lays them out (its tensor names, Q and K rows permuted for the "llama" and "granite"
architectures, Phi-3's fused qkv and gate+up, Llama 3.x's rope_freqs factors), with Q8_0 matmul weights and F32
norms; and the transformers model holding the same weights dequantized (the reference)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from models import gguf_weights
from tests.quant_blocks import llama_cpp_order

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 128, 256, 4, 2, 32, 2
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
# Phi-3.5/4-mini's longrope, scaled down: 256 positions over an original 64 (theirs: 128k over 4k), a short and a
# long factor for each of the 12 rotated frequency pairs (24 of 32 dimensions turn)
PHI3_ORIGINAL = 64
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(12)],
                 "long_factor": [1.0 + 0.6 * i for i in range(12)]}


@dataclass(frozen=True)
class Spec:
    """A family's tiny model: the transformers class and config, the GGUF architecture, and the config.json
    transformers' GGUF conversion would give (`served`: the same config unless the file says less, as for Llama
    3.x, whose rope scaling travels as the rope_freqs tensor, or Mistral, whose files say "llama")."""

    arch: str
    model_type: str
    extra: dict[str, Any] = field(default_factory=dict)
    served_type: str | None = None
    served_drop: tuple[str, ...] = ()
    tied: bool = True
    context: int | None = None  # the context to serve it with against transformers' (None: the model's)


SPECS = {
    "llama3": Spec("llama", "llama", {"rope_scaling": LLAMA3_ROPE}, served_drop=("rope_scaling", "rope_parameters")),
    "mistral": Spec("llama", "mistral", {"sliding_window": None}, served_type="llama", tied=False),
    "qwen2": Spec("qwen2", "qwen2", {}),  # Qwen2 / Qwen2.5: biases on q, k and v; small ones tie the embedding
    "qwen3": Spec("qwen3", "qwen3", {"head_dim": HEAD_DIM}, tied=False),
    "granite": Spec("granite", "granite", {"embedding_multiplier": 6.0, "residual_multiplier": 0.25,
                                           "attention_multiplier": 1 / 16, "logits_scaling": 4.0}),
    "phi3": Spec("phi3", "phi3", {"partial_rotary_factor": 0.75, "pad_token_id": 0}, tied=False),
    "phi4-mini": Spec("phi3", "phi3", {"partial_rotary_factor": 0.75, "pad_token_id": 0}),  # a phi3 file, tied head
    # Phi-3.5/4-mini's long context: the file's factors and attention factor; served within the original context,
    # transformers' short factors (past it, its long ones: test_families.test_phi3_long_factors_past_the_original_context)
    "phi3-long": Spec("phi3", "phi3", {"partial_rotary_factor": 0.75, "pad_token_id": 0,
                                       "original_max_position_embeddings": PHI3_ORIGINAL, "rope_scaling": PHI3_LONGROPE},
                      served_drop=("rope_scaling", "rope_parameters", "original_max_position_embeddings"), tied=False,
                      context=PHI3_ORIGINAL),
    # a window of 4 on the first layer, the second global; soft caps low enough to bind on these random weights
    # (Gemma 2's own: 50 and 30)
    "gemma2": Spec("gemma2", "gemma2", {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 4,
                                        "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
                                        "attn_logit_softcapping": 0.5, "final_logit_softcapping": 50.0}),
    # a window of 4 on the first layer (its RoPE base 10k), the second global (base 1M): both matter within a test
    "gemma3": Spec("gemma3", "gemma3_text", {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM,
                                             "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
                                             "pad_token_id": 0}),
}


def config_of(model_type: str, vocab: int, **extra: Any) -> Any:
    from transformers import AutoConfig

    base = {"vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256,
            "bos_token_id": 0, "eos_token_id": 1, "rms_norm_eps": 1e-5}
    return AutoConfig.for_model(model_type, **{**base, **extra})


def gguf_name(hf: str, arch: str) -> str:
    """transformers parameter name -> llama.cpp's tensor name (the inverse of gguf_weights.hf_name)."""
    for top, ours in gguf_weights.TOP_NAMES.items():
        if hf.startswith(ours + "."):
            return top + hf[len(ours):]
    index, rest = hf.removeprefix("model.layers.").split(".", 1)
    stem, _, kind = rest.rpartition(".")
    names = {**gguf_weights.LAYER_NAMES, **gguf_weights.ARCH_LAYER_NAMES.get(arch, {})}
    return f"blk.{index}.{next(g for g, h in names.items() if h == stem)}.{kind}"


def write_family(folder: Path, family: str, vocab: int, seed: int = 0, tokenizer: Any = None,
                 vocab_file: Path | None = None, chat_template: str | None = None, context: int = 256,
                 extra: dict[str, Any] | None = None, matmul: str = "Q8_0") -> torch.nn.Module:
    """`folder`/tiny.gguf and its config.json; returns the float32 reference on the dequantized weights. With a
    (byte-level BPE) `tokenizer`, or a real one from llama.cpp's vocab-only GGUF `vocab_file` (its `tokenizer.*`
    keys, the token list padded with unused tokens to `vocab`), the file also holds the metadata llama.cpp's
    converter writes (hyperparameters, Granite's multipliers, the tokenizer, `chat_template`), for transformers'
    GGUF conversion and llama.cpp to read. `extra`: config values over the family's own (e.g. another window).
    `matmul`: the matmul weights' type (Q8_0, or F16 / BF16 for a file with no quantized tensor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = SPECS[family]
    torch.manual_seed(seed)
    config = config_of(spec.model_type, vocab, tie_word_embeddings=spec.tied, max_position_embeddings=context,
                       **{**spec.extra, **(extra or {})})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(model)
    served = {k: v for k, v in config.to_dict().items() if k not in (*spec.served_drop, "model_type")}
    AutoConfig.for_model(spec.served_type or spec.model_type, **served).save_pretrained(folder)
    writer = gguf.GGUFWriter(folder / "tiny.gguf", spec.arch)
    if tokenizer is not None or vocab_file is not None:
        _hyperparameters(writer, config)
        if vocab_file is not None:
            _copy_vocab(writer, vocab_file, config.vocab_size)
        else:
            _tokenizer(writer, config, tokenizer)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    state = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and spec.tied:
            continue
        state[name] = _write(writer, name, value, spec.arch, config, GGMLQuantizationType[matmul])
    if family == "llama3":  # Llama 3.x: the factors RoPE's inverse frequencies are divided by
        writer.add_tensor("rope_freqs.weight", _rope_factors(model).numpy())
    if family == "phi3-long":  # as llama.cpp's converter writes longrope (conversion/phi.py)
        for kind in ("short", "long"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(PHI3_LONGROPE[f"{kind}_factor"], np.float32))
        writer.add_rope_scaling_orig_ctx_len(PHI3_ORIGINAL)
        writer.add_rope_scaling_attn_factors(float(model.model.rotary_emb.attention_scaling))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    model.load_state_dict(state, strict=not spec.tied)
    return model


def _write(writer: gguf.GGUFWriter, name: str, value: torch.Tensor, arch: str, config: Any,
           matmul: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> torch.Tensor:
    """Writes one tensor (matmul weights in `matmul`, the rest F32); returns the values the file holds."""
    array = value.detach().float().numpy()
    if array.ndim == 1:  # llama.cpp's converter stores Gemma's norm weights as 1 + w
        writer.add_tensor(gguf_name(name, arch), array + 1 if arch in gguf_weights.NORM_PLUS_ONE else array)
        return value
    blocks = quants.quantize(array.astype(np.float32), matmul)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    permuted = next((h for k, h in heads.items() if f".{k}." in name), None) if arch in ("llama", "granite") else None
    stored = blocks[llama_cpp_order(blocks.shape[0], permuted)] if permuted else blocks
    writer.add_tensor(gguf_name(name, arch), stored, raw_dtype=matmul)
    return torch.from_numpy(quants.dequantize(blocks, matmul).astype(np.float32))


def _hyperparameters(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(int(HEAD_DIM * getattr(config, "partial_rotary_factor", 1.0)))
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 10000.0)))
    if getattr(config, "layer_types", None) and config.sliding_window:  # Gemma 3: llama.cpp's keys, the pattern
        writer.add_sliding_window(config.sliding_window)  # a flag per layer (llama.cpp's default is every 6th global)
        writer.add_array(f"{writer.arch}.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in config.layer_types])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)


def _tokenizer(writer: gguf.GGUFWriter, config: Any, tokenizer: Any) -> None:
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    tokens += [f"<pad{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_unk_token_id(model["vocab"]["<unk>"])  # Gemma's conversion asks for one
    writer.add_pad_token_id(0)  # Phi-3's default (32000) is past a tiny vocabulary


def _copy_vocab(writer: gguf.GGUFWriter, vocab_file: Path, size: int) -> None:
    """The `tokenizer.*` keys of a llama.cpp vocab-only GGUF, its token lists padded to `size` entries."""
    reader = gguf.GGUFReader(vocab_file)
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) <= size, (vocab_file.name, len(tokens), size)
    pad = size - len(tokens)
    padded = {"tokenizer.ggml.tokens": [f"<unused_pad_{i}>" for i in range(pad)],
              "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad, "tokenizer.ggml.scores": [0.0] * pad}
    for key, kv in fields.items():
        value = kv.contents()
        if key in padded:
            value = list(value) + padded[key]
        sub = kv.types[-1] if kv.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kv.types[0], sub_type=sub)


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Weights of unit-scale activations (transformers' init of std 0.02 gives near-uniform logits, whose greedy
    choices are ties): matmuls of std 1 / sqrt(fan in), the LM head three times that, embeddings of std 1, norm
    weights around 1."""
    neutral = 0.0 if model.config.model_type.startswith("gemma") else 1.0  # Gemma's norms use 1 + w
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(neutral + 0.1 * torch.randn_like(p))
        else:
            std = 1.0 if "embed" in name else (3.0 if "lm_head" in name else 1.0) / p.shape[1] ** 0.5
            p.copy_(std * torch.randn_like(p))


def _rope_factors(model: torch.nn.Module) -> torch.Tensor:
    """Llama 3.x rope scaling as llama.cpp's converter writes it: plain RoPE's inverse frequencies over the scaled."""
    dims = torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM
    plain = 1.0 / LLAMA3_ROPE["rope_theta"] ** dims
    return (plain / model.model.rotary_emb.inv_freq.float()).float()
