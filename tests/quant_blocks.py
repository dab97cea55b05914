"""Quantized GGUF blocks for tests: real quantization by the `gguf` package where it has one (Q8_0, Q4_0, Q4_1),
random but well-scaled blocks for the K-quants (gguf.quants can dequantize them, not quantize)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def make_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] in `fmt`, holding values of order 0.1."""
    qtype = GGMLQuantizationType[fmt]
    if fmt not in ("Q4_K", "Q6_K"):
        return quants.quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    scales = {"Q4_K": ((0, 0.0005), (2, 0.0005)), "Q6_K": ((208, 0.00005),)}[fmt]  # (offset, f16 value): d, dmin
    for offset, value in scales:
        half = np.full(blocks.shape[:2], value, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
        blocks[..., offset : offset + 2] = half
    return blocks.reshape(rows, -1)


def dequantize(blocks: np.ndarray, fmt: str) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[fmt]).astype(np.float32)
