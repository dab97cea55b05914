"""KV cache sizing: measured budget, explicit bytes, the useful-size cap, and the zero padding block."""

from __future__ import annotations

import logging
import mmap
from typing import Any

import pytest
import torch

from engine.model.kv_cache import (
    KVCache,
    KVCacheSpec,
    dequantize_kv,
    kv_cache_dtype,
    plan_num_blocks,
    quantize_kv,
)
from engine.types import SamplingParams
from tests.support import make_engine, run_all, tokens_of

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


def test_blocks_are_zeroed_before_first_use() -> None:
    """Where the cache is not anonymous memory (torch.empty: a GPU), blocks are zeroed as they come into use."""
    cache = KVCache(SPEC, num_blocks=200, block_size=4, device=torch.device("cpu"), anonymous=False)
    for t in (*cache.k, *cache.v):
        t[: 200 * 4].fill_(float("nan"))  # what never-written memory may hold
    cache.ensure_zeroed(3)
    assert torch.count_nonzero(cache.k[0][: 64 * 4]) == 0  # zeroed in steps of 64 blocks
    assert torch.isnan(cache.v[1][64 * 4]).all()
    cache.ensure_zeroed(150)
    assert torch.count_nonzero(cache.v[1][: 150 * 4]) == 0


def test_cpu_cache_reads_zero_and_gives_back_the_windowed_layers_pages() -> None:
    """On the CPU each tensor is an anonymous mapping, page aligned, reading zero until written (nothing zeroed at
    start); `release` gives back the pages of the given blocks in the windowed layers only (they read zero again)."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, windows=(8, 0))
    cache = KVCache(spec, num_blocks=8, block_size=16, device=torch.device("cpu"))  # a block: 4 KiB a tensor
    assert cache.block_bytes == 4096 and cache.release_window == 8
    assert all(t.data_ptr() % mmap.PAGESIZE == 0 and torch.count_nonzero(t) == 0 for t in (*cache.k, *cache.v))
    for t in (*cache.k, *cache.v):
        t[: 8 * 16].fill_(1.0)
    cache.release([5, 2, 3])
    assert cache.released_bytes_total == 2 * 3 * 4096  # K and V of the one windowed layer, 3 blocks

    def per_block(t: torch.Tensor) -> list[int]:
        return t[: 8 * 16].reshape(8, -1).count_nonzero(dim=1).tolist()

    written = 16 * 2 * 32
    assert per_block(cache.k[0]) == per_block(cache.v[0]) == [written, written, 0, 0, written, 0, written, written]
    assert per_block(cache.k[1]) == per_block(cache.v[1]) == [written] * 8  # the global layer keeps everything
    cache.k[0][2 * 16].fill_(3.0)  # a given-back block written again: its page faults back in
    assert cache.k[0][2 * 16].eq(3.0).all() and torch.count_nonzero(cache.k[0][2 * 16 + 1 : 3 * 16]) == 0


def test_nothing_is_given_back_without_a_window_a_whole_page_or_the_setting() -> None:
    cpu = torch.device("cpu")
    windowed = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, windows=(8, 0))
    assert KVCache(windowed, 8, 16, cpu, release=False).release_window == 0
    assert KVCache(windowed, 8, 8, cpu).release_window == 0  # 2 KiB blocks: no whole page inside one
    assert KVCache(SPEC, 8, 16, cpu).release_window == 0  # no windowed layer
    small = KVCache(windowed, 8, 8, cpu)
    small.k[0].fill_(1.0)
    small.release([1, 2, 3])
    assert small.released_bytes_total == 0 and torch.count_nonzero(small.k[0][:64]) == 64 * 2 * 32


def test_decode_is_not_poisoned_by_unwritten_memory(tiny: Any, engine_factory: Any) -> None:
    from engine.types import SamplingParams
    from tests.support import run_all, tokens_of

    clean = engine_factory(tiny)
    poisoned = engine_factory(tiny)
    for t in (*poisoned.kv_cache.k, *poisoned.kv_cache.v):
        t[: poisoned.kv_cache.num_slots].fill_(float("nan"))
    prompt = tiny.tokenizer.encode("Hello world")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert tokens_of(run_all(poisoned, {"p": (prompt, params)})["p"]) == tokens_of(
        run_all(clean, {"c": (prompt, params)})["c"])


def test_kv_cache_dtype_auto_is_the_model_dtype_and_float16_holds_twice_the_tokens(tiny: Any,
                                                                                   engine_factory: Any) -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32) == torch.float16
    assert kv_cache_dtype("int8", torch.bfloat16) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype("float8_e4m3fn", torch.float32)
    full = engine_factory(tiny, kv_cache_bytes=1 << 20)  # tiny is float32
    half = engine_factory(tiny, kv_cache_bytes=1 << 20, kv_cache_dtype="float16")
    assert full.kv_cache.k[0].dtype == torch.float32 and half.kv_cache.k[0].dtype == torch.float16
    assert half.kv_cache.num_slots == 2 * full.kv_cache.num_slots
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kernel = tokens_of(run_all(half, {"a": ([5, 6, 7], params)})["a"])  # tiny: op by op, the attention kernel
    # torch's ops: SDPA over the gathered float16 blocks, widened to q's dtype
    torch_ops = engine_factory(tiny, kv_cache_bytes=1 << 20, kv_cache_dtype="float16", cpu_kernels=False)
    assert torch_ops.kv_cache.k[0].dtype == torch.float16
    assert tokens_of(run_all(torch_ops, {"a": ([5, 6, 7], params)})["a"]) == kernel and len(kernel) == 6


def test_kv_cache_dtype_auto_is_float16_over_quantized_weights(smollm2_q4_1: Any) -> None:
    """A GGUF kept quantized (float32 activations): auto is float16, as llama.cpp keeps its cache, and the engine's
    cache is; a dtype asked for is kept, and a bfloat16 model's auto stays bfloat16."""
    assert kv_cache_dtype("auto", torch.float32, quantized=True) == torch.float16
    assert kv_cache_dtype("auto", torch.float32) == torch.float32  # dense float32 weights
    assert kv_cache_dtype("auto", torch.bfloat16, quantized=True) == torch.bfloat16
    assert kv_cache_dtype("float32", torch.float32, quantized=True) == torch.float32
    auto = make_engine(smollm2_q4_1, kv_cache_bytes=1 << 20)
    wide = make_engine(smollm2_q4_1, kv_cache_bytes=1 << 20, kv_cache_dtype="float32")
    assert auto.kv_cache.k[0].dtype == torch.float16 and wide.kv_cache.k[0].dtype == torch.float32
    assert auto.kv_cache.num_slots == 2 * wide.kv_cache.num_slots
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(tokens_of(run_all(auto, {"a": ([1, 2, 3, 4], params)})["a"])) == 8


def test_int8_rows_keep_each_value_within_half_a_step_of_their_scale() -> None:
    """`--kv-cache-dtype int8`: a row of head_dim values becomes int8 with one float32 scale max|x| / 127; each
    value comes back within half a step (scale / 2), the row's largest exactly, a zero row as zeros."""
    torch.manual_seed(0)
    x = torch.randn(64, 4, 64) * torch.logspace(-3, 2, 64)[:, None, None]  # rows of very different sizes
    x[5, 2, 7] = 400.0  # an outlier sets its row's step
    x[9, 1] = 0.0
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64, 4)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    back = dequantize_kv(q, scale)
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-5)).all()
    assert float(back[5, 2, 7]) == pytest.approx(400.0, rel=1e-6)
    assert not back[9, 1].any() and not q[9, 1].any() and float(scale[9, 1]) == 0.0
    assert torch.equal(quantize_kv(x.to(torch.bfloat16))[0], quantize_kv(x.to(torch.bfloat16).float())[0])


def test_int8_cache_size_and_layout() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.int8)
    assert spec.bytes_per_token == 2 * 2 * 2 * (16 + 4)  # the values and a float32 scale per row
    cache = KVCache(spec, num_blocks=4, block_size=16, device=torch.device("cpu"))
    assert cache.quantized and cache.k[0].dtype == torch.int8 and cache.k[0].shape == (5 * 16, 2, 16)
    assert [s.shape for s in (*cache.k_scale, *cache.v_scale)] == [(5 * 16, 2)] * 4
    assert all(s.dtype == torch.float32 and not s.any() for s in (*cache.k_scale, *cache.v_scale))
    assert not KVCache(SPEC, num_blocks=4, block_size=16, device=torch.device("cpu")).k_scale


def test_int8_kv_cache_holds_what_was_written_and_generates(tiny: Any, engine_factory: Any) -> None:
    """An int8 cache fits 3.2x the float32 cache's tokens at head_dim 16 (16 + 4 bytes a row against 64); after a
    request its slots hold the float32 run's keys and values to within half a step, and greedy tokens come out the
    same through SDPA over the dequantized blocks (kernels on: the decode kernel takes no int8 cache) and through the
    row-by-row pass (kernels off)."""
    full = engine_factory(tiny, kv_cache_bytes=1 << 20)  # tiny is float32
    small = engine_factory(tiny, kv_cache_bytes=1 << 20, kv_cache_dtype="int8")
    assert small.kv_cache.quantized and small.kv_cache.k[0].dtype == torch.int8
    assert small.kv_cache.num_slots // 16 == (1 << 20) // (16 * small.kv_cache.spec.bytes_per_token)
    assert 3.0 <= small.kv_cache.num_slots / full.kv_cache.num_slots <= 3.3
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = tiny.tokenizer.encode("Hello world, once more")
    reference = tokens_of(run_all(full, {"a": (prompt, params)})["a"])
    sdpa = tokens_of(run_all(small, {"a": (prompt, params)})["a"])
    rows = engine_factory(tiny, kv_cache_bytes=1 << 20, kv_cache_dtype="int8", cpu_kernels=False)
    assert tokens_of(run_all(rows, {"a": (prompt, params)})["a"]) == sdpa and len(sdpa) == 6
    assert sdpa == reference  # the float32 run's top two are 0.09 or more apart; int8 moved logprobs by 0.03
    n = len(prompt) + 5  # the slots written: the prompt, then one per decode step but the last
    for cache, scales, ref in ((small.kv_cache.k, small.kv_cache.k_scale, full.kv_cache.k),
                               (small.kv_cache.v, small.kv_cache.v_scale, full.kv_cache.v)):
        step = scales[0][: len(prompt)]  # the first layer's prompt slots: the same inputs in both runs
        back = dequantize_kv(cache[0][: len(prompt)], step)
        assert ((back - ref[0][: len(prompt)]).abs() <= step[..., None] / 2 + 1e-6).all()
        for layer in range(len(scales)):  # every layer wrote its n slots, and only those
            assert scales[layer][:n].gt(0).all() and not scales[layer][n:].any()
