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


def test_measure_orders_the_formats(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    torch.manual_seed(1)
    ids = torch.randint(3, 200, (1, 96))
    head_dim = tiny.model.config.hidden_size // tiny.model.config.num_attention_heads
    formats = {"float32": bench_kv_accuracy.formats(head_dim)["float32"],
               "float16": bench_kv_accuracy.formats(head_dim)["float16"],
               "int8": bench_kv_accuracy.formats(head_dim)["int8"],
               "int8/8": (lambda x: bench_kv_accuracy.grouped_int8(x, 8),) * 2}
    monkeypatch.setattr(bench_kv_accuracy, "formats", lambda _: formats)
    results = bench_kv_accuracy.measure(tiny.model, ids, 64, head_dim)
    assert results["float32"] == {"kl_mean": 0.0, "kl_max": 0.0, "top1_same": 1.0, "logit_diff_max": 0.0}
    assert 0 < results["float16"]["kl_mean"] < results["int8"]["kl_mean"]
    assert results["int8/8"]["logit_diff_max"] < results["int8"]["logit_diff_max"]
