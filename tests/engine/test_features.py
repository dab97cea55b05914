"""Stop strings, stop tokens, EOS, n > 1, logprobs, preemption, abort and limits on the tiny model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.types import InvalidRequestError, PromptTooLongError, SamplingParams
from tests.support import hf_attention, run_all, text_of, tokens_of

PROMPT = "The quick brown fox"


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **kw})


@pytest.fixture
def engine(tiny: Any, engine_factory: Any) -> Any:
    return engine_factory(tiny, max_num_batched_tokens=32)


def reference(engine: Any, tiny: Any) -> tuple[list[int], list[int], str]:
    prompt = tiny.tokenizer.encode(PROMPT)
    ids = tokens_of(run_all(engine, {"ref": (prompt, greedy())})["ref"])
    return prompt, ids, tiny.tokenizer.decode(ids)


def test_stop_string_across_token_boundary_is_never_streamed(engine: Any, tiny: Any) -> None:
    prompt, ids, full = reference(engine, tiny)
    boundary = len(tiny.tokenizer.decode(ids[:6]))
    stop = full[boundary - 2 : boundary + 2]  # two characters from each side of a token boundary
    assert len(stop) == 4
    outs = run_all(engine, {"s": (prompt, greedy(stop=(stop,)))})["s"]
    cut = full.find(stop)
    assert text_of(outs) == full[:cut]
    assert all(stop[:2] not in o.text or o.text.find(stop[:2]) < cut for o in outs)
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop)
    kept = run_all(engine, {"k": (prompt, greedy(stop=(stop,), include_stop_str_in_output=True))})["k"]
    assert text_of(kept) == full[: cut + len(stop)]


def test_stop_token_id_and_eos(engine: Any, tiny: Any) -> None:
    prompt, ids, _ = reference(engine, tiny)
    stop_id = ids[4]
    outs = run_all(engine, {"t": (prompt, greedy(stop_token_ids=(stop_id,)))})["t"]
    first = ids.index(stop_id)
    assert tokens_of(outs) == ids[: first + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop_id)
    assert text_of(outs) == tiny.tokenizer.decode(ids[:first])  # the stop token's text is not emitted
    eos = tiny.tokenizer.eos_token_id
    forced = {eos: 100.0}
    stopped = run_all(engine, {"e": (prompt, greedy(ignore_eos=False, logit_bias=forced))})["e"]
    assert tokens_of(stopped) == [eos] and stopped[-1].finish_reason == "stop"
    ignored = run_all(engine, {"i": (prompt, greedy(ignore_eos=True, logit_bias=forced, max_tokens=5))})["i"]
    assert tokens_of(ignored) == [eos] * 5 and ignored[-1].finish_reason == "length"
    held = run_all(engine, {"m": (prompt, greedy(ignore_eos=False, logit_bias=forced, min_tokens=3))})["m"]
    assert len(tokens_of(held)) == 4 and held[-1].finish_reason == "stop"


def test_n_greater_than_one(engine: Any, tiny: Any) -> None:
    prompt = tiny.tokenizer.encode(PROMPT)
    outs = run_all(engine, {"n": (prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                                         ignore_eos=True))})["n"]
    seqs = [tokens_of(outs, i) for i in range(3)]
    assert all(len(s) == 12 for s in seqs) and len({tuple(s) for s in seqs}) == 3
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    again = run_all(engine, {"n": (prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                                          ignore_eos=True))})["n"]
    assert [tokens_of(again, i) for i in range(3)] == seqs
    same = run_all(engine, {"g": (prompt, greedy(n=2, max_tokens=8))})["g"]
    assert tokens_of(same, 0) == tokens_of(same, 1)


def test_logprobs_match_a_direct_forward_pass(engine: Any, tiny: Any) -> None:
    prompt = tiny.tokenizer.encode(PROMPT)
    outs = run_all(engine, {"l": (prompt, greedy(max_tokens=6, logprobs=3))})["l"]
    ids = tokens_of(outs)
    with torch.inference_mode(), hf_attention(tiny.model):
        logits = tiny.model(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # the distributions the tokens came from
    for step, out in enumerate(outs):
        (lp,) = out.logprobs
        assert lp.token_id == ids[step]
        assert lp.logprob == pytest.approx(float(ref[step, ids[step]]), abs=1e-4)
        top = ref[step].topk(3)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.token == tiny.tokenizer.decode([ids[step]])


def test_preemption_under_kv_pressure_keeps_outputs_exact(tiny: Any, engine_factory: Any) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in ["Hello world", "def add(a, b):", "Numbers: 0 1 2", PROMPT]]
    requests = {f"r{i}": (p, greedy(max_tokens=40)) for i, p in enumerate(prompts)}
    roomy = engine_factory(tiny)
    expected = {rid: tokens_of(o) for rid, o in run_all(roomy, requests).items()}
    block_bytes = roomy.kv_cache.spec.bytes_per_token * 16
    tight = engine_factory(tiny, kv_cache_bytes=8 * block_bytes)  # 128 token slots for ~4 x 50 tokens
    got = {rid: tokens_of(o) for rid, o in run_all(tight, requests).items()}
    assert tight.scheduler.preemptions_total > 0
    assert got == expected


def test_abort_mid_generation_frees_kv_now(engine: Any, tiny: Any) -> None:
    engine.add_request("a", tiny.tokenizer.encode(PROMPT), greedy(max_tokens=100))
    engine.add_request("b", tiny.tokenizer.encode("Hello"), greedy(max_tokens=100))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    (out,) = engine.abort_request("a")
    assert out.finish_reason == "abort" and out.request_id == "a"
    used_by_b = len(engine.scheduler.running[0].block_table)
    assert engine.blocks.num_used_blocks == used_by_b
    engine.abort_request("b")
    assert engine.blocks.num_used_blocks == 0 and not engine.has_work


def test_max_tokens_absent_means_rest_of_context(tiny: Any, engine_factory: Any) -> None:
    probe = engine_factory(tiny)
    small = engine_factory(tiny, kv_cache_bytes=4 * probe.kv_cache.spec.bytes_per_token * 16)
    assert small.max_model_len == 64  # clamped to what the KV cache holds
    prompt = tiny.tokenizer.encode(PROMPT)
    outs = run_all(small, {"x": (prompt, SamplingParams(temperature=0.0, ignore_eos=True))})["x"]
    assert len(tokens_of(outs)) == 64 - len(prompt) and outs[-1].finish_reason == "length"


def test_invalid_requests_are_rejected_before_running(engine: Any) -> None:
    with pytest.raises(PromptTooLongError) as err:
        engine.add_request("x", [5] * engine.max_model_len, greedy())
    assert err.value.param == "prompt_token_ids"
    with pytest.raises(PromptTooLongError) as err:
        engine.add_request("x", [5, 6], greedy(max_tokens=engine.max_model_len))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", [], greedy())
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", [engine.vocab_size], greedy())
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("x", [5], greedy(top_p=0.0))
    assert err.value.param == "top_p"
    assert not engine.has_work
