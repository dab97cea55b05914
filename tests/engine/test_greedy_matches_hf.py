"""Greedy output equals transformers' own generate, token for token, alone and in mixed batches.

Float32 throughout: in bfloat16 the paged attention and transformers' SDPA round differently and
near-tied logits can flip, which would make an exact comparison flaky.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.types import SamplingParams
from tests.support import chat_ids, hf_greedy, run_all, text_of, tokens_of

TINY_PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 6,  # longer than one prefill chunk
    "def add(a, b):",
    "Café 東京 🦅",
]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_refs(tiny: Any) -> list[tuple[list[int], list[int]]]:
    prompts = [tiny.tokenizer.encode(p) for p in TINY_PROMPTS]
    return [(p, hf_greedy(tiny.model, p, 24)) for p in prompts]


IMPLS = pytest.mark.parametrize("impl", ["llama", "generic"])


@IMPLS
def test_tiny_batch_of_one_matches_hf(tiny: Any, tiny_refs: list, engine_factory: Any, impl: str) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=16, model_impl=impl)
    assert engine.runner.impl == impl
    for prompt, ref in tiny_refs:
        outs = run_all(engine, {"r": (prompt, greedy(24))})["r"]
        assert tokens_of(outs) == ref
        assert text_of(outs) == tiny.tokenizer.decode(ref, skip_special_tokens=True)
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 24


@IMPLS
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_tiny_mixed_batch_with_chunked_prefill_matches_hf(tiny: Any, tiny_refs: list, engine_factory: Any,
                                                          impl: str, kernels: bool) -> None:
    """Both decode-attention paths: engine.backends.cpu_kernels' and the gather + masked SDPA one used where the
    kernels do not run (CUDA, CPUs without AVX-512, --no-cpu-kernels)."""
    engine = engine_factory(tiny, max_num_batched_tokens=16, model_impl=impl, cpu_kernels=kernels)
    # staggered lengths so prefill chunks and decodes share steps
    requests = {f"r{i}": (prompt, greedy(24 - 3 * i)) for i, (prompt, _) in enumerate(tiny_refs)}
    outs = run_all(engine, requests)
    for i, (_, ref) in enumerate(tiny_refs):
        assert tokens_of(outs[f"r{i}"]) == ref[: 24 - 3 * i]


def test_tiny_requests_joining_mid_flight_match_hf(tiny: Any, tiny_refs: list, engine_factory: Any) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=32)
    collected: dict[str, list] = {f"r{i}": [] for i in range(len(tiny_refs))}
    pending = list(enumerate(tiny_refs))
    while pending or engine.has_work:
        if pending:  # one new request every step while others decode
            i, (prompt, _) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy(24))
        for out in engine.step():
            collected[out.request_id].append(out)
    for i, (_, ref) in enumerate(tiny_refs):
        assert tokens_of(collected[f"r{i}"]) == ref


@pytest.mark.slow
def test_smollm2_matches_hf_alone_and_batched(smollm2_fp32: Any, engine_factory: Any) -> None:
    tok = smollm2_fp32.tokenizer
    prompts = [chat_ids(tok, "What is the capital of France?"), chat_ids(tok, "Name three colors.")]
    refs = [hf_greedy(smollm2_fp32.model, p, 12) for p in prompts]
    engine = engine_factory(smollm2_fp32, kv_cache_bytes=32 << 20, max_num_batched_tokens=64)
    assert engine.runner.impl == "llama"  # SmolLM2 is a Llama: the fast path is what runs by default
    alone = run_all(engine, {"a": (prompts[0], greedy(12))})["a"]
    assert tokens_of(alone) == refs[0]
    together = run_all(engine, {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts)})
    assert [tokens_of(together[f"r{i}"]) for i in range(2)] == refs
    assert text_of(alone) == tok.decode(refs[0], skip_special_tokens=True)


def test_generic_path_is_used_for_non_llama_models(tiny: Any) -> None:
    from engine.model.forward import supports
    from engine.model.runner import choose_impl

    assert supports(tiny.model) and choose_impl(tiny.model, "auto") == "llama"
    assert choose_impl(tiny.model, "generic") == "generic"
    with pytest.raises(ValueError):
        choose_impl(tiny.model, "turbo")


def tiny_qwen2(tiny: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.support import Loaded

    config = Qwen2Config(vocab_size=len(tiny.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.15, tie_word_embeddings=False)
    torch.manual_seed(7)
    return Loaded(Qwen2ForCausalLM(config).eval(), tiny.tokenizer, 256)


@pytest.mark.parametrize("impl", ["generic", "auto"])
def test_both_forward_passes_serve_qwen2(engine_factory: Any, tiny: Any, impl: str) -> None:
    """A tiny random Qwen2 (q/k/v biases) matches transformers' generate on the generic path and on the
    Llama fast path, which "auto" picks for it."""
    qwen = tiny_qwen2(tiny)
    engine = engine_factory(qwen, max_num_batched_tokens=16, model_impl=impl)
    assert engine.runner.impl == ("generic" if impl == "generic" else "llama")
    prompts = [tiny.tokenizer.encode(t) for t in TINY_PROMPTS[:3]]
    outs = run_all(engine, {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert tokens_of(outs[f"r{i}"]) == hf_greedy(qwen.model, p, 12)


def tiny_gpt_oss(tiny: Any) -> Any:
    """A tiny random gpt-oss: attention sinks (drawn large, so ignoring them changes the tokens), sliding-window
    layers interleaved with full ones, a mixture of experts."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.support import Loaded

    config = GptOssConfig(vocab_size=len(tiny.tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                          layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    torch.manual_seed(11)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return Loaded(model, tiny.tokenizer, 256)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_gpt_oss_attention_sinks_match_hf(engine_factory: Any, tiny: Any, kernels: bool) -> None:
    """gpt-oss on the generic path: each softmax takes its head's sink (`s_aux`) as transformers' does; prompts past
    the window, batched with chunked prefill."""
    oss = tiny_gpt_oss(tiny)
    engine = engine_factory(oss, max_num_batched_tokens=16, cpu_kernels=kernels)
    assert engine.runner.impl == "generic"
    prompts = [tiny.tokenizer.encode(t) for t in TINY_PROMPTS[:3]]
    outs = run_all(engine, {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert tokens_of(outs[f"r{i}"]) == hf_greedy(oss.model, p, 12)


def test_the_fast_path_leaves_sliding_windows_and_other_blocks_to_the_generic_one(tiny: Any) -> None:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from engine.model.forward import supports

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}
    assert supports(MistralForCausalLM(MistralConfig(**small, sliding_window=None)))
    assert not supports(MistralForCausalLM(MistralConfig(**small, sliding_window=16)))
    assert not supports(Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=16,
                                                     max_window_layers=0)))
    assert not supports(Qwen2ForCausalLM(Qwen2Config(**small, hidden_act="gelu")))


@pytest.mark.slow
def test_smollm2_bfloat16_fast_path_stays_close_to_hf(smollm2: Any, engine_factory: Any) -> None:
    """bfloat16 is the CPU default. Exact equality is too strict there (see the module docstring), but the fast
    path must not drift from transformers' own bf16 answer on an easy question: a float32-free RMSNorm once
    turned "Paris" into "L'Étoile"."""
    tok = smollm2.tokenizer
    prompt = chat_ids(tok, "What is the capital of France?")
    ref = hf_greedy(smollm2.model, prompt, 8)
    engine = engine_factory(smollm2, kv_cache_bytes=32 << 20, max_num_batched_tokens=64)
    assert engine.runner.impl == "llama"
    got = tokens_of(run_all(engine, {"a": (prompt, greedy(8))})["a"])
    assert "Paris" in tok.decode(got), tok.decode(got)
    assert got[:6] == ref[:6]
