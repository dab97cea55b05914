"""Batching invariance: what else is in the batch never changes a request's answer."""

from __future__ import annotations

from typing import Any

from engine.types import SamplingParams
from tests.support import run_all, text_of, tokens_of


def test_eight_identical_greedy_requests_match_the_lone_request(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=64)
    prompt = tiny.tokenizer.encode("Peregrine falcons are the fastest birds")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = tokens_of(run_all(engine, {"solo": (prompt, params)})["solo"])
    outs = run_all(engine, {f"r{i}": (prompt, params) for i in range(8)})
    assert all(tokens_of(outs[f"r{i}"]) == alone for i in range(8))


def test_seeded_sampling_is_independent_of_batch_mates(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=64)
    enc = tiny.tokenizer.encode
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = run_all(engine, {"s": (enc("Hello world"), seeded)})["s"]
    mates = {
        f"m{i}": (enc(text), SamplingParams(temperature=0.8, max_tokens=5 + 3 * i, ignore_eos=True))
        for i, text in enumerate(["The quick brown fox " * 4, "def add(a, b):", "Numbers: 0 1 2"])
    }
    outs = run_all(engine, {**mates, "s": (enc("Hello world"), seeded)})
    assert tokens_of(outs["s"]) == tokens_of(alone)
    assert text_of(outs["s"]) == text_of(alone)
    unseeded = [tokens_of(run_all(engine, {"u": (enc("Hello world"), SamplingParams(
        temperature=1.0, max_tokens=20, ignore_eos=True))})["u"]) for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # without a seed, draws differ (the seed is what makes them equal)


def test_decode_steps_get_the_same_inputs_from_the_fast_path(tiny: Any, engine_factory: Any) -> None:
    """`ModelRunner.prepare_decodes` (every decode step) builds what the general `prepare_mixed` builds: token
    ids, positions, slots, lengths, logits rows, block tables padded to the widest (contexts of 1 to 5 blocks)."""
    import torch

    engine = engine_factory(tiny, max_num_batched_tokens=512, block_size=16)
    enc = tiny.tokenizer.encode
    for i, text in enumerate(["Hi", "The quick brown fox jumps " * 3, "Numbers: " + " ".join(map(str, range(30)))]):
        engine.add_request(f"r{i}", enc(text), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    checked = 0
    while engine.has_work:
        out = engine.scheduler.schedule()
        if all(s.num_tokens == 1 for s in out.scheduled) and len(out.scheduled) == 3:
            fast, general = engine.runner.prepare_decodes(out.scheduled), engine.runner.prepare_mixed(out)
            for name in ("input_ids", "positions", "logits_indices"):
                assert torch.equal(getattr(fast, name), getattr(general, name)), name
            for name in ("slot_mapping", "decode_block_tables", "decode_lengths"):
                assert torch.equal(getattr(fast.meta, name), getattr(general.meta, name)), name
            assert fast.meta.num_decodes == general.meta.num_decodes == 3 and fast.meta.prefills == ()
            checked += 1
        logits = engine.runner.run(out)
        sampled = engine.sampler.sample(logits, [s.seq for s in out.sampling])
        for seq, tok in zip(engine.scheduler.update(out, [s.token_id for s in sampled]), sampled, strict=True):
            engine._emit(seq, tok)
    assert checked >= 30
