"""Automatic prefix caching on real models: the same greedy answers as with the cache off, on every forward
path (Llama fast path and generic; CPU kernels on and off), fewer tokens computed, no block leaked."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.backends import cpu_kernels
from engine.types import SamplingParams
from tests.support import chat_ids, run_all, tokens_of

SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain words. " * 3


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def waves(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Run the first prompt alone (it fills the cache), the middle ones together (prefills after a cached
    prefix share steps with decodes), and the last alone; returns each one's tokens."""
    last = len(prompts) - 1
    first = run_all(engine, {"w0": (prompts[0], greedy(max_tokens))})
    middle = run_all(engine, {f"w{i}": (p, greedy(max_tokens)) for i, p in enumerate(prompts) if 0 < i < last})
    outs = first | middle | run_all(engine, {f"w{last}": (prompts[last], greedy(max_tokens))})
    return [tokens_of(outs[f"w{i}"]) for i in range(len(prompts))]


def one_token_after_the_cache(prompt: list[int], block_size: int = 16) -> list[int]:
    """A prompt that repeats whole cached blocks of `prompt` plus one token: only that token is computed, as
    a single-token item (the decode path: on CPU in bfloat16, the one-call decode step)."""
    return prompt[: (len(prompt) - 1) // block_size * block_size + 1]


def test_second_chat_turn_computes_only_its_new_tokens(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=64)
    enc, bs = tiny.tokenizer.encode, engine.blocks.block_size
    turn1 = enc(SYSTEM + "User: name a bird.\nAssistant:")
    out1 = run_all(engine, {"t1": (turn1, greedy(12))})["t1"]
    reply = tokens_of(out1)
    assert out1[-1].cached_tokens == 0
    turn2 = turn1 + reply + enc("\nUser: and a fish?\nAssistant:")
    before = engine.stats()
    out2 = run_all(engine, {"t2": (turn2, greedy(6))})["t2"]
    after = engine.stats()
    published = len(turn1) + len(reply) - 1  # the last sampled token of turn 1 never had its K/V computed
    expected = min(common_prefix(turn1 + reply, turn2), published, len(turn2) - 1) // bs * bs
    assert expected >= len(turn1) // bs * bs > 0
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    assert hits == expected and out2[-1].cached_tokens == expected
    assert after.prefix_cache_queries_total - before.prefix_cache_queries_total == len(turn2)
    # prefill ran over the new tokens only; then one position per decoded token after the first
    assert after.computed_tokens_total - before.computed_tokens_total == len(turn2) - expected + 6 - 1


@pytest.mark.parametrize("impl", ["llama", "generic"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_tiny_greedy_is_identical_with_and_without_caching(tiny: Any, engine_factory: Any, impl: str,
                                                           kernels: bool) -> None:
    enc = tiny.tokenizer.encode
    prompts = [enc(SYSTEM + q) for q in ("Hello world", "def add(a, b):", "Numbers: 0 1 2", "Café 東京 🦅")]
    prompts.append(list(prompts[0]))  # an exact repeat: all but the last block come from the cache
    prompts.append(one_token_after_the_cache(prompts[1]))
    results, engines = {}, {}
    for caching in (True, False):
        engine = engines[caching] = engine_factory(tiny, max_num_batched_tokens=32, model_impl=impl,
                                                   cpu_kernels=kernels, prefix_caching=caching)
        results[caching] = waves(engine, prompts, 16)
    assert results[True] == results[False]
    assert engines[True].stats().prefix_cache_hits_total >= 5 * (len(enc(SYSTEM)) // 16 * 16)
    assert engines[False].stats().prefix_cache_hits_total == 0


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [True], ids=["cpu-kernels"])  # torch's ops: the tiny models' test above (the
def test_bundled_model_greedy_is_identical_with_and_without_caching(smollm2: Any, engine_factory: Any,  # bundled
                                                                   kernels: bool) -> None:  # model's took minutes)
    tok = smollm2.tokenizer
    questions = ("What is the capital of France?", "Name a colour of the sky.", "What is 2 + 2?")
    prompts = [chat_ids(tok, SYSTEM + q) for q in questions]
    prompts.append(one_token_after_the_cache(prompts[1]))
    results = {}
    for caching in (True, False):
        engine = engine_factory(smollm2, kv_cache_bytes=32 << 20, max_num_batched_tokens=256, cpu_kernels=kernels,
                                prefix_caching=caching)
        results[caching] = waves(engine, prompts, 12)
        assert (engine.stats().prefix_cache_hits_total > 0) is caching
        # bf16 decode steps run as one kernel call where this CPU can build the kernels, else torch's ops
        assert (engine.runner._forward._decoder is not None) is (kernels and cpu_kernels.unsupported_reason() is None)
    assert results[True] == results[False], [tok.decode(t) for t in results[True] + results[False]]
    assert "Paris" in tok.decode(results[True][0])


def _random_workload(rng: random.Random, enc: Any) -> list[tuple[str, list[int], SamplingParams]]:
    heads = [enc(SYSTEM[: rng.randrange(20, len(SYSTEM))]) for _ in range(3)]
    words = ["bird", "fish", "tree", "river", "stone", "cloud", "wind", "fire", "snow", "leaf"]
    requests = []
    for i in range(14):
        tail = enc(" " + " ".join(rng.choice(words) for _ in range(rng.randrange(1, 6))))
        kind = rng.random()
        params = (greedy(rng.randrange(4, 24)) if kind < 0.6 else
                  greedy(rng.randrange(4, 12), n=2) if kind < 0.8 else
                  SamplingParams(temperature=0.9, seed=rng.randrange(1000), max_tokens=rng.randrange(4, 16),
                                 ignore_eos=True))
        requests.append((f"r{i}", rng.choice(heads) + tail, params))
    return requests


def _outputs_by_index(outs: list) -> dict[int, list[int]]:
    return {i: tokens_of(outs, i) for i in sorted({o.index for o in outs})}


def test_random_shared_prefixes_with_aborts_and_preemption_match_cache_off(tiny: Any, engine_factory: Any) -> None:
    """Requests arrive at random steps over a few shared prefixes (greedy, n = 2, seeded sampling); some are
    aborted mid-way; the KV budget is small enough to force preemption. Every finished answer equals the
    cache-off answer, every aborted one is a prefix of it, and at the end every block is free or cached."""
    rng = random.Random(1717)
    requests = _random_workload(rng, tiny.tokenizer.encode)
    reference_engine = engine_factory(tiny, max_num_batched_tokens=48, prefix_caching=False)
    reference = {rid: _outputs_by_index(outs) for rid, outs in
                 run_all(reference_engine, {rid: (p, sp) for rid, p, sp in requests}).items()}
    block_bytes = reference_engine.kv_cache.spec.bytes_per_token * 16
    engine = engine_factory(tiny, max_num_batched_tokens=48, kv_cache_bytes=14 * block_bytes)
    arrivals = sorted((rng.randrange(0, 60), rid, p, sp) for rid, p, sp in requests)
    aborts = {rid: rng.randrange(2, 12) for _, rid, _, _ in rng.sample(arrivals, 3)}
    outs: dict[str, list] = {rid: [] for _, rid, _, _ in arrivals}
    added: dict[str, int] = {}
    for step in range(5000):
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, params = arrivals.pop(0)
            engine.add_request(rid, prompt, params)
            added[rid] = step
        for rid, after in aborts.items():
            if rid in added and step == added[rid] + after:
                engine.abort_request(rid)
        for out in engine.step():
            outs[out.request_id].append(out)
        if not arrivals and not engine.has_work:
            break
    assert not engine.has_work
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    for rid, got in outs.items():
        for index, tokens in _outputs_by_index(got).items():
            if rid in aborts:
                assert tokens == reference[rid][index][: len(tokens)], rid
            else:
                assert tokens == reference[rid][index], rid
    blocks = engine.blocks
    assert blocks.num_used_blocks == 0 and blocks.num_free_blocks == blocks.num_blocks
    assert blocks.num_cached_blocks > 0


def test_eviction_under_memory_pressure_never_fails_a_request(tiny: Any, engine_factory: Any) -> None:
    probe = engine_factory(tiny, prefix_caching=False)
    block_bytes = probe.kv_cache.spec.bytes_per_token * 16
    engine = engine_factory(tiny, kv_cache_bytes=8 * block_bytes)  # 128 token slots
    enc = tiny.tokenizer.encode
    for i in range(6):  # distinct prompts fill the cache with idle blocks
        outs = run_all(engine, {f"fill{i}": (enc(f"{i} " + SYSTEM[i * 7 : i * 7 + 60]), greedy(8))})[f"fill{i}"]
        assert outs[-1].finish_reason == "length"
    assert engine.blocks.num_cached_blocks > 0 and engine.blocks.num_used_blocks == 0
    long_prompt = enc(SYSTEM)[:100]
    requests = {"whole": (long_prompt, greedy(128 - len(long_prompt)))}  # needs every slot of the cache
    requests |= {f"more{i}": (enc(f"other {i}: " + SYSTEM[:40]), greedy(20)) for i in range(3)}
    outs = run_all(engine, requests)
    assert all(o[-1].finish_reason == "length" and o[-1].error is None for o in outs.values())
    assert len(tokens_of(outs["whole"])) == 128 - len(long_prompt)
    assert engine.blocks.evictions_total > 0
