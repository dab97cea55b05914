"""scripts/bench_kv_accuracy.py on the tiny random Llama: its formats round as the cache does, and its measure tells
the formats apart (the float32 row is the reference itself; float16 closer than int8; a scale per 8 values
closer than one per head row)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_kv_accuracy  # noqa: E402

from engine.model.kv_cache import dequantize_kv, quantize_kv  # noqa: E402


def test_a_group_of_the_whole_row_is_the_int8_cache() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, 16) * torch.linspace(0.1, 4, 16)
    torch.testing.assert_close(bench_kv_accuracy.grouped_int8(x, 16), dequantize_kv(*quantize_kv(x)), rtol=0, atol=0)
    finer = bench_kv_accuracy.grouped_int8(x, 8)
    assert (finer - x).abs().mean() < (bench_kv_accuracy.grouped_int8(x, 16) - x).abs().mean()
    assert set(bench_kv_accuracy.formats(16)) == {"float32", "float16", "bfloat16", "int8", "int8 K", "int8 V"}
    assert {"int8/32", "int8/16"} <= set(bench_kv_accuracy.formats(64))


def test_measure_orders_the_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a random 2-layer Llama of its own (the shared `tiny` fixture's model attends through the engine's paged
    attention once an engine has served it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 256, (1, 96))
    head_dim = config.hidden_size // config.num_attention_heads
    every = bench_kv_accuracy.formats(head_dim)
    formats = {name: every[name] for name in ("float32", "float16", "int8")}
    formats["int8/8"] = (lambda x: bench_kv_accuracy.grouped_int8(x, 8),) * 2
    monkeypatch.setattr(bench_kv_accuracy, "formats", lambda _: formats)
    results = bench_kv_accuracy.measure(model, ids, 64, head_dim)
    assert results["float32"] == {"kl_mean": 0.0, "kl_max": 0.0, "top1_same": 1.0, "logit_diff_max": 0.0}
    assert 0 < results["float16"]["kl_mean"] < results["int8"]["kl_mean"]
    assert results["int8/8"]["kl_mean"] < results["int8"]["kl_mean"]
