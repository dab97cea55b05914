"""`--quantize int8` (linear weights of a safetensors model to Q8_0 at load) and the preflight's arithmetic for a
GGUF kept quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from engine.model.quant import QuantLinear, quantize_q8_0, resident_bytes
from engine.types import EngineConfig
from models import memory, preflight
from models.loader import load_model
from tests.quant_blocks import write_tiny_gguf


def test_q8_0_blocks_equal_gguf_quantize() -> None:
    """Our Q8_0 blocks dequantize to what gguf's reference quantizer gives, within one int8 step of rounding."""
    w = torch.randn(8, 256)
    ours = quants.dequantize(quantize_q8_0(w).blocks.numpy(), GGMLQuantizationType.Q8_0)
    ref = quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    step = np.abs(w.numpy()).reshape(8, 8, 32).max(-1, keepdims=True) / 127
    assert (np.abs(ours - ref).reshape(8, 8, 32) <= step * 1.01).all()


def test_quantize_int8_loads_quantized_and_stays_close(tiny_model_dir: object) -> None:
    """Bound: Q8_0 weights (a rounding step of 1/127 of each block's largest weight) move the random tiny model's
    logits by an RMS < 3% of theirs (measured: about 1.8%); one linear's output by < 1% (measured: about 0.5%)."""
    base = {"model_path": str(tiny_model_dir.path), "model_name": "tiny", "device": "cpu", "dtype": "float32"}
    dense = load_model(EngineConfig(**base)).model
    quantized = load_model(EngineConfig(**base, quantize="int8")).model
    linears = [m for m in quantized.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the untied LM head
    assert resident_bytes(quantized) < 0.5 * resident_bytes(dense)
    ids = torch.tensor([[1, 5, 9, 30, 77, 100]])
    with torch.inference_mode():
        want, got = dense(ids).logits, quantized(ids).logits
    rms = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert rms < 0.03, f"relative RMS error {rms:.3g}"
    x = torch.randn(3, quantized.model.layers[0].mlp.up_proj.in_features)
    one, ref = quantized.model.layers[0].mlp.up_proj(x), dense.model.layers[0].mlp.up_proj(x)
    assert (one - ref).pow(2).mean().sqrt() < 0.01 * ref.pow(2).mean().sqrt()


def test_preflight_counts_gguf_tensor_bytes(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path, {"*": "Q4_1", "token_embd": "Q8_0"}, vocab=512)
    from models.gguf_weights import tensor_bytes

    fp = preflight.gguf_footprint(tmp_path / "tiny.gguf", cached=False, quantized=True)
    assert fp.weight_bytes == tensor_bytes(tmp_path / "tiny.gguf") and fp.convert_bytes == 0
    need, words = memory.memory_need(fp, "auto", max_model_len=None, kv_cache_bytes=None)
    kv = 2 * fp.kv.layers * fp.kv.kv_heads * fp.kv.head_dim * 4 * fp.context_len  # float32 activations and KV cache, no dtype probe
    assert need == fp.weight_bytes + kv and "quantized (GGUF tensors)" in words
    dense = preflight.gguf_footprint(tmp_path / "tiny.gguf", cached=False)
    assert dense.weight_bytes is None and dense.convert_bytes == dense.param_count * 4
