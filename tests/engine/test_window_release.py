"""Sliding-window layers give back the KV pages of blocks behind every window (engine/model/kv_cache.py `release`,
engine/core/block_manager.py `retire`), on tiny Gemma 3 models (tests/family_gguf.py: the first layer windowed, the
second global): greedy answers are the same with the release on and off, over prompts many windows long and long
decodes, on every attention path (the one-call step, the op-by-op rows, torch's ops); the given-back pages read as
zero in the windowed layer only; a prefix-cache hit after a release is the answer the cache-off engine gives."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.types import SamplingParams
from models import gguf_weights
from tests.family_gguf import write_family
from tests.support import Loaded, make_engine, run_all, tokens_of

pytestmark = pytest.mark.timeout(900)
CONTEXT = 512
KV_BYTES = 2 << 20  # 2048 tokens of the tiny model's 1 KiB a token
# in float32: a block of the tiny model's float16 cache (a quantized model's default) is half a page, and only whole
# pages are given back (a real Gemma 3's float16 blocks are 8 KiB)
F32 = {"kv_cache_dtype": "float32"}


def vocab_of(tokenizer: object) -> int:
    n = len(tokenizer)
    return n + (-n) % 32


@pytest.fixture(scope="module", params=[4, 40], ids=["window4", "window40"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          byte_level_tokenizer: object) -> tuple[Loaded, Loaded]:
    """(quantized, dense) tiny Gemma 3 of the same weights, its first layer in a window of 4 or 40 (a block is 16)."""
    folder = tmp_path_factory.mktemp(f"gemma3-w{request.param}")
    dense = write_family(folder, "gemma3", vocab_of(byte_level_tokenizer), context=CONTEXT,
                         extra={"sliding_window": request.param})
    quantized = gguf_weights.load(folder / "tiny.gguf", folder, torch.float32, context=CONTEXT)
    assert quantized.config.sliding_window == request.param
    return Loaded(quantized, byte_level_tokenizer, CONTEXT), Loaded(dense.eval(), byte_level_tokenizer, CONTEXT)


def prompt(seed: int, length: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


REQUESTS = {"long": (prompt(1, 200), greedy(120)), "mid": (prompt(2, 90), greedy(150)), "short": (prompt(3, 7), greedy(60))}


@pytest.mark.parametrize("path", ["quantized", "dense", "torch", "generic"])
def test_greedy_answers_are_the_same_with_the_release_on_and_off(gemma: tuple[Loaded, Loaded], path: str) -> None:
    """quantized: every step in the one-call decoder; dense: prompts op by op (the windowed layer's rows), decodes
    in the decoder; torch: --cpu-kernels off, every token a row of torch ops; generic: transformers' Gemma 3 module
    calling the paged attention (with the `sliding_window` it passes)."""
    loaded = gemma[0] if path == "quantized" else gemma[1]
    kw: dict[str, Any] = {**F32, "kv_cache_bytes": KV_BYTES, "max_num_batched_tokens": 64,
                          "cpu_kernels": path != "torch", "model_impl": "generic" if path == "generic" else "auto"}
    on = make_engine(loaded, **kw)
    off = make_engine(loaded, kv_window_release=False, **kw)
    assert on.kv_cache.release_window == loaded.model.config.sliding_window and off.kv_cache.release_window == 0
    answers_on = {rid: tokens_of(outs) for rid, outs in run_all(on, REQUESTS).items()}
    answers_off = {rid: tokens_of(outs) for rid, outs in run_all(off, REQUESTS).items()}
    assert answers_on == answers_off
    assert [len(answers_on[rid]) for rid in REQUESTS] == [120, 150, 60]
    assert on.blocks.released_blocks_total > 0 and on.kv_cache.released_bytes_total > 0
    assert off.blocks.released_blocks_total == 0 and off.kv_cache.released_bytes_total == 0
    assert on.blocks.num_used_blocks == off.blocks.num_used_blocks == 0
    # the long request's blocks behind its window were given back in the windowed layer (0), not the global one (1)
    cache, bs = on.kv_cache, on.kv_cache.block_size
    released = [b for b in range(cache.num_blocks) if on.blocks.is_released(b)]
    assert released
    for b in released:
        assert torch.count_nonzero(cache.k[0][b * bs : (b + 1) * bs]) == 0
        assert torch.count_nonzero(cache.v[0][b * bs : (b + 1) * bs]) == 0
        assert torch.count_nonzero(cache.k[1][b * bs : (b + 1) * bs]) > 0


def test_a_prefix_hit_after_a_release_gives_the_cache_off_answer(gemma: tuple[Loaded, Loaded]) -> None:
    """After `first` ran (its early blocks given back): the same prompt again (its cached blocks are ones the windowed
    layer would read from where it starts: the hit is shortened or dropped) and the next turn of the conversation (a
    hit of the whole first exchange: the windows start past every released block), against the cache-off engine.
    Quantized, so every step is the one-call decoder: a prompt gives the same bits whole, chunked or after cached
    blocks, and the answers must agree exactly."""
    loaded = gemma[0]
    window = loaded.model.config.sliding_window
    kw: dict[str, Any] = {**F32, "kv_cache_bytes": KV_BYTES, "max_num_batched_tokens": 64}
    cached = make_engine(loaded, **kw)
    plain = make_engine(loaded, prefix_caching=False, **kw)
    first = prompt(4, 150)
    answer = tokens_of(run_all(cached, {"first": (first, greedy(80))})["first"])
    assert tokens_of(run_all(plain, {"first": (first, greedy(80))})["first"]) == answer
    assert cached.blocks.released_blocks_total > 0
    follow_up = first + answer + prompt(5, 20)
    requests = {"again": (first, greedy(40)), "turn": (follow_up, greedy(40))}
    outs = run_all(cached, requests)
    reference = run_all(plain, requests)
    assert {rid: tokens_of(o) for rid, o in outs.items()} == {rid: tokens_of(o) for rid, o in reference.items()}
    bs = cached.kv_cache.block_size
    # a hit of P positions is computed from P on, and the windowed layer reads from P + 1 - window: every released
    # block of the hit ends before that
    released_first = (len(first) + len(answer) - 1 + 1 - window) // bs - 1  # blocks `first` gave back
    full_hit = (len(first) - 1) // bs * bs
    assert outs["again"][0].cached_tokens < full_hit or released_first * bs <= full_hit + 1 - window
    assert outs["turn"][0].cached_tokens >= (len(first) + len(answer) - 1) // bs * bs  # the whole first exchange


def test_layer_windows_are_the_windows_transformers_modules_apply() -> None:
    """engine.model.families.layer_windows, what the KV cache gives back behind: the `sliding_window` each of
    transformers' attention modules passes to the paged attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.model.families import layer_windows

    small = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
             "num_attention_heads": 2, "num_key_value_heads": 1}
    configs = {
        "gemma3_text": {"head_dim": 32, "sliding_window": 8,
                        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        "mistral": {"sliding_window": 16},
        "qwen2": {"use_sliding_window": False, "sliding_window": 16},
        "llama": {},
    }
    expected = {"gemma3_text": (8, 0, 8), "mistral": (16, 16, 16), "qwen2": (0, 0, 0), "llama": (0, 0, 0)}
    for model_type, extra in configs.items():
        config = AutoConfig.for_model(model_type, **small, **extra)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        if model_type == "mistral":  # MistralAttention passes the config's window
            passed = tuple(config.sliding_window for _ in model.model.layers)
        else:
            passed = tuple(getattr(layer.self_attn, "sliding_window", None) or 0 for layer in model.model.layers)
        assert layer_windows(config) == expected[model_type] == passed, model_type
