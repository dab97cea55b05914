"""Prompt logprobs from the prefill: equal to a direct forward pass, over chunked prefill, both forward
passes, the one-call CPU decode kernel, and preemption; requests that do not ask are unaffected."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.backends import cpu_kernels
from engine.types import InvalidRequestError, SamplingParams
from tests.support import hf_attention, run_all, tokens_of

TEXT = "Paged attention stores keys and values in fixed-size blocks of memory. The quick brown fox jumps."


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, **kw})


def reference(loaded: Any, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: log p(token i + 1 | tokens 0..i) from transformers' own forward pass."""
    with torch.inference_mode(), hf_attention(loaded.model):
        logits = loaded.model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check(outs: list, prompt: list[int], ref: torch.Tensor, k: int, tol: float, tokenizer: Any) -> None:
    firsts = [o for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0] is outs[0], "prompt logprobs ride on the first output only"
    entries = firsts[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i, e in enumerate(entries[1:]):
        assert e.token_id == prompt[i + 1] and e.token == tokenizer.decode([prompt[i + 1]])
        assert e.logprob == pytest.approx(float(ref[i, prompt[i + 1]]), abs=tol)
        if tol < 1e-3:  # float32: the same ranking as the reference
            assert e.rank == int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
        assert len(e.top) == k
        if k:
            assert [t.logprob for t in e.top] == pytest.approx(ref[i].topk(k).values.tolist(), abs=tol)


@pytest.mark.parametrize("impl", ["generic", "llama"])
@pytest.mark.parametrize("budget", [8, 512])  # chunked prefill (8-token chunks) and one-chunk prefill
def test_prompt_logprobs_equal_a_direct_forward_pass(tiny: Any, engine_factory: Any, impl: str,
                                                     budget: int) -> None:
    engine = engine_factory(tiny, model_impl=impl, max_num_batched_tokens=budget)
    prompt = tiny.tokenizer.encode(TEXT)
    assert len(prompt) > 3 * 8
    other = tiny.tokenizer.encode("Hello world! How are you today?")
    alone = tokens_of(run_all(engine, {"o": (other, greedy())})["o"])
    outs = run_all(engine, {"p": (prompt, greedy(prompt_logprobs=3)), "o": (other, greedy())})
    check(outs["p"], prompt, reference(tiny, prompt), 3, 1e-4, tiny.tokenizer)
    assert tokens_of(outs["o"]) == alone and all(o.prompt_logprobs is None for o in outs["o"])
    assert tokens_of(outs["p"]) == tokens_of(run_all(engine, {"q": (prompt, greedy())})["q"])


def test_prompt_logprobs_with_n_and_zero_alternatives(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=16)
    prompt = tiny.tokenizer.encode(TEXT)
    outs = run_all(engine, {"n": (prompt, greedy(n=2, prompt_logprobs=0))})["n"]
    ref = reference(tiny, prompt)
    for index in (0, 1):
        check([o for o in outs if o.index == index], prompt, ref, 0, 1e-4, tiny.tokenizer)


def test_prompt_logprobs_survive_preemption(tiny: Any, engine_factory: Any) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in [TEXT, "def add(a, b):\n    return a + b", "Numbers: 0 1 2 3"]]
    roomy = engine_factory(tiny)
    block_bytes = roomy.kv_cache.spec.bytes_per_token * 16
    tight = engine_factory(tiny, kv_cache_bytes=8 * block_bytes, max_num_batched_tokens=16)
    requests = {f"r{i}": (p, greedy(max_tokens=60, prompt_logprobs=1)) for i, p in enumerate(prompts)}
    outs = run_all(tight, requests)
    assert tight.scheduler.preemptions_total > 0
    for i, p in enumerate(prompts):
        check(outs[f"r{i}"], p, reference(tiny, p), 1, 1e-4, tiny.tokenizer)


def test_prompt_logprobs_of_a_cached_prompt_are_computed_in_full(tiny: Any, engine_factory: Any) -> None:
    """The prompt is in the prefix cache already: a request asking for prompt logprobs computes it anyway
    (cached positions would have no logits), and one that does not ask still reuses the cache."""
    engine = engine_factory(tiny, max_num_batched_tokens=16, prefix_caching=True)
    prompt = tiny.tokenizer.encode(TEXT)
    run_all(engine, {"warm": (prompt, greedy())})
    computed = engine.stats().computed_tokens_total
    outs = run_all(engine, {"p": (prompt, greedy(prompt_logprobs=2))})["p"]
    check(outs, prompt, reference(tiny, prompt), 2, 1e-4, tiny.tokenizer)
    assert outs[-1].cached_tokens == 0
    assert engine.stats().computed_tokens_total - computed >= len(prompt)
    again = run_all(engine, {"q": (prompt, greedy())})["q"]
    assert again[-1].cached_tokens > 0


def test_prompt_logprobs_out_of_range_are_refused(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", [1, 2, 3], greedy(prompt_logprobs=21))
    assert info.value.param == "prompt_logprobs"


@pytest.mark.skipif(cpu_kernels.unsupported_reason() is not None, reason="no CPU kernels here")
def test_smollm2_bf16_prompt_logprobs_through_the_cpu_kernels(smollm2: Any, engine_factory: Any) -> None:
    """bf16 on CPU: prefill chunks op by op with the small-batch kernel, and (budget 2, a decode running
    beside) one-token prompt chunks through the one-call decode kernel. bf16 keeps 8 bits of mantissa, so
    logits near 20 are only resolved to ~0.1 and transformers' own bf16 pass rounds differently: measured
    on AVX512-BF16, mean |diff| 0.05-0.09 nats, max 0.27; on the AVX2 path (bf16 widened to float32 in
    registers, rounded back between ops), mean 0.10, max 0.54. The bounds (mean 0.15, max 0.8) catch a wrong
    row or a wrong position (errors of nats) while allowing that rounding."""
    tok = smollm2.tokenizer
    prompt = tok.encode(TEXT)
    ref = reference(smollm2, prompt)
    expected = torch.tensor([float(ref[i, t]) for i, t in enumerate(prompt[1:])])
    for budget in (16, 2):
        engine = engine_factory(smollm2, kv_cache_bytes=32 << 20, max_num_batched_tokens=budget)
        requests = {"d": (tok.encode("Hello"), greedy(max_tokens=len(prompt) + 8)),
                    "p": (prompt, greedy(prompt_logprobs=2))}
        entries = run_all(engine, requests)["p"][0].prompt_logprobs
        assert entries[0] is None and [e.token_id for e in entries[1:]] == prompt[1:]
        diff = (torch.tensor([e.logprob for e in entries[1:]]) - expected).abs()
        assert diff.mean() < 0.15 and diff.max() < 0.8, (budget, diff.mean(), diff.max())
        assert all(len(e.top) == 2 and e.top[0].logprob >= e.logprob - 1e-6 for e in entries[1:])
