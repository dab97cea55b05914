"""Constrained decoding in the engine: on the tiny random model (any answer a grammar allows is as likely as the
next, so only the grammar keeps it valid) and on the bundled SmolLM2. Answers that end by `stop` parse and
validate; batch mates, preemption, n > 1, seeds, stop strings, logprobs and lazy triggers keep working."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest

from engine.sampling.sampler import MIN_LOGPROB
from engine.types import Constraint, InvalidRequestError, SamplingParams
from tests.support import PERSON, chat_ids, run_all, text_of, tokens_of

FINITE = {  # a finite language: every answer ends by the grammar, whatever the model
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}
def schema(s: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", json.dumps(s))


def finished(outs: list, index: int = 0) -> Any:
    last = [o for o in outs if o.index == index][-1]
    assert last.finished
    return last


def test_finite_schema_greedy_and_sampled_always_stop_and_validate(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny)
    prompt = tiny.tokenizer.encode("Numbers: 0 1 2")
    outs = run_all(engine, {
        "greedy": (prompt, SamplingParams(temperature=0, max_tokens=60, constraint=schema(FINITE))),
        "sampled": (prompt, SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=60, constraint=schema(FINITE))),
    })
    for rid, n in (("greedy", 1), ("sampled", 4)):
        for i in range(n):
            assert finished(outs[rid], i).finish_reason == "stop"
            jsonschema.validate(json.loads(text_of(outs[rid], i)), FINITE)
    assert len({text_of(outs["sampled"], i) for i in range(4)}) > 1  # n > 1: independent sequences
    assert not engine._grammars  # every sequence's matcher is released


def test_regex_choice_and_grammars(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny)
    prompt = tiny.tokenizer.encode("Hello world")
    cases = {
        "regex": (Constraint("regex", r"\d{3}-\d{4}"), r"^[0-9]{3}-[0-9]{4}$"),
        "choice": (Constraint("choice", '["alpha", "beta", "gamma delta"]'), r"^(alpha|beta|gamma delta)$"),
        "gbnf": (Constraint("gbnf", 'root ::= "id:" [a-c]{2} ("!" | "?")'), r"^id:[a-c]{2}[!?]$"),
        "lark": (Constraint("lark", 'start: "x" NUM\nNUM: /[0-9]{2}/'), r"^x[0-9]{2}$"),
        "json_object": (Constraint("json_object", ""), None),
    }
    outs = run_all(engine, {k: (prompt, SamplingParams(temperature=0.9, seed=3, max_tokens=200, constraint=c))
                            for k, (c, _) in cases.items()})
    import re

    for k, (_, pattern) in cases.items():
        text = text_of(outs[k])
        if k == "json_object":
            if finished(outs[k]).finish_reason == "stop":
                assert isinstance(json.loads(text), dict)
            continue
        assert finished(outs[k]).finish_reason == "stop", (k, text)
        assert re.match(pattern, text), (k, text)


def test_seeded_constrained_request_ignores_its_batch_mates(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=64)
    enc = tiny.tokenizer.encode
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=60, constraint=schema(FINITE))
    alone = run_all(engine, {"s": (enc("Hello world"), seeded)})["s"]
    mates = {
        "free": (enc("The quick brown fox " * 3), SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)),
        "greedy": (enc("def add(a, b):"), SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)),
        "other": (enc("Numbers: 0 1 2"), SamplingParams(temperature=0.7, max_tokens=40,
                                                         constraint=Constraint("regex", "[a-z ]{5,30}"))),
    }
    outs = run_all(engine, {**mates, "s": (enc("Hello world"), seeded)})
    assert tokens_of(outs["s"]) == tokens_of(alone)
    assert text_of(outs["s"]) == text_of(alone)


def test_free_rows_are_untouched_by_constrained_mates(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny, max_num_batched_tokens=64)
    enc = tiny.tokenizer.encode
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    free_seeded = SamplingParams(temperature=0.9, seed=99, max_tokens=30, ignore_eos=True)
    alone = run_all(engine, {"f": (enc("Paged attention"), free), "g": (enc("Hello"), free_seeded)})
    constrained = {f"c{i}": (enc("Numbers"), SamplingParams(temperature=0.8, seed=i, max_tokens=40,
                                                            constraint=schema(FINITE))) for i in range(3)}
    outs = run_all(engine, {**constrained, "f": (enc("Paged attention"), free), "g": (enc("Hello"), free_seeded)})
    for rid in ("f", "g"):
        assert tokens_of(outs[rid]) == tokens_of(alone[rid])
    got = [lp for o in outs["f"] for lp in o.logprobs]
    want = [lp for o in alone["f"] for lp in o.logprobs]
    # the same tokens, and logprobs up to float rounding (the forward pass of a bigger batch rounds differently)
    assert [(g.token_id, [t.token_id for t in g.top]) for g in got] == [(w.token_id, [t.token_id for t in w.top])
                                                                       for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)


def test_preemption_with_recompute_keeps_constrained_outputs_exact(tiny: Any, engine_factory: Any) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in ["Hello world", "def add(a, b):", "Numbers: 0 1 2", "The fox"]]
    requests = {
        f"r{i}": (p, SamplingParams(temperature=0.9, seed=i, max_tokens=45,
                                    constraint=Constraint("regex", "[a-z]{30,60}[.!]")))
        for i, p in enumerate(prompts)
    }
    roomy = engine_factory(tiny)
    expected = {rid: tokens_of(o) for rid, o in run_all(roomy, requests).items()}
    block_bytes = roomy.kv_cache.spec.bytes_per_token * 16
    tight = engine_factory(tiny, kv_cache_bytes=4 * block_bytes)  # 64 token slots for 4 x ~50 tokens
    got = run_all(tight, requests)
    assert tight.scheduler.preemptions_total > 0
    assert {rid: tokens_of(o) for rid, o in got.items()} == expected
    for outs in got.values():
        assert finished(outs).finish_reason in ("stop", "length")


def test_lazy_trigger_leaves_text_free_until_the_trigger(tiny: Any, engine_factory: Any) -> None:
    """logit_bias makes the model write one word at once; from there on the regex holds (the bias cannot win
    against the mask), and the grammar's end stops the sequence."""
    engine = engine_factory(tiny)
    tok = tiny.tokenizer
    word_id = next(t for t in range(len(tok)) if tok.decode([t]).strip().isalpha() and len(tok.decode([t])) >= 4)
    word = tok.decode([word_id])
    params = SamplingParams(temperature=0, max_tokens=30, logit_bias={word_id: 100.0},
                            constraint=Constraint("regex", "[0-9]{3};", trigger=word.strip()))
    outs = run_all(engine, {"lazy": (tok.encode("Hello"), params)})["lazy"]
    text = text_of(outs)
    assert text.startswith(word) and finished(outs).finish_reason == "stop"
    rest = text[len(word):]
    assert len(rest) == 4 and rest[:3].isdigit() and rest.endswith(";"), text
    free = run_all(engine, {"free": (tok.encode("Hello"), SamplingParams(
        temperature=0, max_tokens=8, constraint=Constraint("regex", "[0-9]{3};", trigger="never-written")))})
    assert finished(free["free"]).finish_reason == "length"  # no trigger: free text to the end


def test_stop_strings_and_logprobs_with_a_constraint(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny)
    prompt = tiny.tokenizer.encode("Hello")
    outs = run_all(engine, {
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=20, stop=("world",),
                                        constraint=Constraint("choice", '["hello world!"]'))),
        "lp": (prompt, SamplingParams(temperature=0.8, seed=5, max_tokens=20, logprobs=5,
                                      constraint=Constraint("choice", '["yes", "no"]'))),
    })
    last = finished(outs["stop"])
    assert text_of(outs["stop"]) == "hello " and last.finish_reason == "stop" and last.stop_reason == "world"
    lps = [lp for o in outs["lp"] for lp in (o.logprobs or [])]
    assert text_of(outs["lp"]) in ("yes", "no") and lps
    first = lps[0]
    assert first.logprob > MIN_LOGPROB  # the chosen token: finite, from the masked distribution
    allowed = [t for t in first.top if t.logprob > MIN_LOGPROB]
    assert all(t.logprob == MIN_LOGPROB for t in first.top[len(allowed):])
    # the allowed first tokens carry all the probability mass of the masked distribution
    assert math.isclose(sum(math.exp(t.logprob) for t in allowed), 1.0, rel_tol=1e-4)


def test_length_cut_and_invalid_constraint(tiny: Any, engine_factory: Any) -> None:
    engine = engine_factory(tiny)
    prompt = tiny.tokenizer.encode("Hello")
    outs = run_all(engine, {"cut": (prompt, SamplingParams(temperature=0, max_tokens=3,
                                                           constraint=Constraint("regex", "[a-z]{10}")))})
    assert finished(outs["cut"]).finish_reason == "length" and len(text_of(outs["cut"])) <= 10
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", prompt, SamplingParams(constraint=Constraint("regex", "((")))
    assert not engine.has_work


# ---------------------------------------------------------------- the bundled SmolLM2


def test_smollm2_json_schema_greedy_and_sampled(smollm2: Any, engine_factory: Any) -> None:
    engine = engine_factory(smollm2, kv_cache_bytes=64 << 20)
    prompt = chat_ids(smollm2.tokenizer, "Describe a person as JSON with a name and an age.")
    outs = run_all(engine, {
        "greedy": (prompt, SamplingParams(temperature=0, max_tokens=80, constraint=schema(PERSON))),
        "sampled": (prompt, SamplingParams(temperature=0.8, n=3, seed=11, max_tokens=80, constraint=schema(PERSON))),
        "object": (prompt, SamplingParams(temperature=0, max_tokens=120, constraint=Constraint("json_object", ""))),
        "free": (prompt, SamplingParams(temperature=0, max_tokens=30)),
    })
    assert finished(outs["greedy"]).finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(outs["greedy"])), PERSON)
    stopped = 0
    for i in range(3):
        if finished(outs["sampled"], i).finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text_of(outs["sampled"], i)), PERSON)
    assert stopped >= 1
    if finished(outs["object"]).finish_reason == "stop":
        assert isinstance(json.loads(text_of(outs["object"])), dict)


def test_smollm2_regex_and_choice(smollm2: Any, engine_factory: Any) -> None:
    engine = engine_factory(smollm2, kv_cache_bytes=64 << 20)
    tok = smollm2.tokenizer
    outs = run_all(engine, {
        "date": (chat_ids(tok, "When did the Apollo 11 landing happen? Answer with a date."),
                 SamplingParams(temperature=0, max_tokens=20, constraint=Constraint("regex", r"\d{4}-\d{2}-\d{2}"))),
        "choice": (chat_ids(tok, "Is the sky blue? Answer yes or no."),
                   SamplingParams(temperature=0, max_tokens=5, constraint=Constraint("choice", '["yes", "no"]'))),
    })
    import re

    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text_of(outs["date"]))
    assert text_of(outs["choice"]) in ("yes", "no")
    assert all(finished(o).finish_reason == "stop" for o in outs.values())


def test_one_mask_fill_per_step_for_all_constrained_rows(tiny: Any, engine_factory: Any, monkeypatch) -> None:
    from engine.sampling import grammar

    engine = engine_factory(tiny)
    calls: list[int] = []
    real = grammar.BitmaskFiller.fill
    monkeypatch.setattr(grammar.BitmaskFiller, "fill", lambda self, states: calls.append(len(states))
                        or real(self, states))
    prompt = tiny.tokenizer.encode("Hello")
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=6, constraint=Constraint("regex", "[a-z]{6}"))
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, params)
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    assert len(calls) <= steps and max(calls) == 6  # six constrained rows, one call; the free row needs none
