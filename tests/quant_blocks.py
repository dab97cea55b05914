"""Quantized GGUF blocks for tests: real quantization by the `gguf` package where it has one (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1), random but well-scaled blocks for the K-quants and IQ4_NL / IQ4_XS (gguf.quants can dequantize them, not
quantize: random bytes with their f16 scale fields set; Q3_K, which the kernels do not take, for the fallback's
tests)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from models import gguf_weights

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")  # engine/model/quant.py's
KQUANTS = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # super-blocks of 256 values (rows a multiple of 256; Q8_K activations)
# The formats made of random bytes with their f16 scales set: (offset, f16 value) of d (and dmin) in a block.
RANDOM_SCALES = {"Q4_K": ((0, 0.0005), (2, 0.0005)), "Q5_K": ((0, 0.00025), (2, 0.0005)), "Q6_K": ((208, 0.00005),),
                 "Q3_K": ((108, 0.0005),), "IQ4_NL": ((0, 0.0015),), "IQ4_XS": ((0, 0.0001),)}
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # the tiny GGUF Llama (K-quants need rows of 256)


def make_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] in `fmt`, holding values of order 0.1."""
    qtype = GGMLQuantizationType[fmt]
    if fmt not in RANDOM_SCALES:
        return quants.quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    for offset, value in RANDOM_SCALES[fmt]:
        half = np.full(blocks.shape[:2], value, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
        blocks[..., offset : offset + 2] = half
    return blocks.reshape(rows, -1)


def dequantize(blocks: np.ndarray, fmt: str) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[fmt]).astype(np.float32)


def llama_cpp_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter permutes Q and K rows for its RoPE: file row i holds HF row order[i]."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


def write_tiny_gguf(folder: Path, formats: dict[str, str], vocab: int) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF (tied embedding) with each matmul weight in formats[kind] ("attn_q", "ffn_down",
    "token_embd", ... or "*" for the rest). Returns the HF-named float32 weights it holds (dequantized)."""
    from transformers import LlamaConfig

    rng = np.random.default_rng(7)
    LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                tie_word_embeddings=True, bos_token_id=0, eos_token_id=1).save_pretrained(folder)
    writer = gguf.GGUFWriter(folder / "tiny.gguf", "llama")
    dense: dict[str, np.ndarray] = {}
    shapes = {"attn_q": HIDDEN, "attn_k": HIDDEN // HEADS * KV_HEADS, "attn_v": HIDDEN // HEADS * KV_HEADS,
              "attn_output": HIDDEN, "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": HIDDEN}
    names = [("token_embd.weight", vocab, HIDDEN)] + [
        (f"blk.{i}.{kind}.weight", rows, FFN if kind == "ffn_down" else HIDDEN)
        for i in range(LAYERS) for kind, rows in shapes.items()]  # fmt: skip
    for name, rows, cols in names:
        kind = name.split(".")[-2]
        fmt = formats.get(kind, formats["*"])
        blocks = make_blocks(fmt, rows, cols, rng)
        dense[gguf_weights.hf_name(name)] = dequantize(blocks, fmt)
        heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(kind)
        stored = blocks[llama_cpp_order(rows, heads)] if heads else blocks
        writer.add_tensor(name, stored, raw_dtype=gguf.GGMLQuantizationType[fmt])
    norms = [f"blk.{i}.{k}.weight" for i in range(LAYERS) for k in ("attn_norm", "ffn_norm")] + ["output_norm.weight"]
    for name in norms:
        value = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        dense[gguf_weights.hf_name(name)] = value
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dense
