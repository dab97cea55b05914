"""KV cache sizing: measured budget, explicit bytes, the useful-size cap, and the zero padding block."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec, plan_num_blocks

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)  # 256 bytes / token


def test_bytes_per_token() -> None:
    assert SPEC.bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_budget_from_fraction_of_free_or_explicit_bytes() -> None:
    block = SPEC.bytes_per_token * 16
    assert plan_num_blocks(SPEC, 16, free_bytes=100 * block, fraction=0.5, explicit_bytes=None,
                           max_useful_tokens=10**9) == 50
    assert plan_num_blocks(SPEC, 16, free_bytes=100 * block, fraction=0.5, explicit_bytes=7 * block,
                           max_useful_tokens=10**9) == 7
    assert plan_num_blocks(SPEC, 16, free_bytes=100 * block, fraction=0.9, explicit_bytes=None,
                           max_useful_tokens=33) == 3  # never more than max_num_seqs * max_model_len
    with pytest.raises(MemoryError, match="kv_cache"):
        plan_num_blocks(SPEC, 16, free_bytes=block, fraction=0.5, explicit_bytes=None, max_useful_tokens=100)


def test_cache_layout_and_padding_block_is_zero() -> None:
    cache = KVCache(SPEC, num_blocks=4, block_size=8, device=torch.device("cpu"))
    assert len(cache.k) == len(cache.v) == 2
    assert cache.k[0].shape == (5 * 8, 2, 16) and cache.null_block == 4
    assert cache.nbytes == 4 * 8 * SPEC.bytes_per_token
    assert torch.count_nonzero(cache.k[1][32:]) == 0 and torch.count_nonzero(cache.v[0][32:]) == 0


def test_engine_logs_kv_size_and_reports_usage(tiny: Any, engine_factory: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = engine_factory(tiny, kv_cache_bytes=1 << 20)
    assert any("KV cache:" in r.message and "tokens" in r.message and "MiB" in r.message for r in caplog.records)
    stats = engine.stats()
    assert stats.kv_total_tokens == engine.kv_cache.num_slots and stats.kv_used_blocks == 0
    assert engine.kv_cache.nbytes <= 1 << 20
