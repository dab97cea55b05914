"""Speculative decoding (n-gram proposals, `speculative="ngram"`) in the engine, on the default path: the bundled
SmolLM2 Q4_1 kept quantized, the one-call step of Peregrine's CPU kernels. With speculation on, a request gets the
same tokens as without: greedy token for token, seeded sampling number for number (the sampler draws a position's
token with the same random number either way), with penalties, logprobs, stop strings and max_tokens exact,
several requests batched with continuous batching, preempted, and after its blocks went through the prefix cache.
Each check also asserts that proposals were made and accepted, so the speculative path really ran."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.types import Constraint, SamplingParams
from tests.support import (
    PERSON,
    Loaded,
    chat_ids,
    make_engine,
    pin,
    run_all,
    text_of,
    tokens_of,
)

pytestmark = pytest.mark.timeout(1800)

PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the "
           "ninety steps, trimmed the wick and wound the clockwork that turned the lens. Ships passing the reef "
           "saw its beam every twelve seconds and steered wide of the rocks.")
COPY = "Repeat the following passage exactly, word for word:\n\n" + PASSAGE
EDIT = ("Rewrite this passage, changing 'lighthouse' to 'tower' and keeping everything else the same:\n\n" + PASSAGE)
CODE = ("Add a docstring to this Python function and return the whole function:\n\n"
        "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n")
OPEN = "Write a short poem about the sea at night."


def engines(loaded: Loaded, **overrides: Any) -> tuple[Any, Any]:
    """A plain engine and a speculative one. The speculative one's step cost is pinned at about what a step of this
    model costs on two cores (3 ms and 0.3 ms a row): these tests check answers and that proposals ran, and on a busy
    machine the measured cost can make rows look too dear to propose (the adaptive rule has its own unit tests)."""
    settings = {"kv_cache_bytes": 64 << 20, "max_num_batched_tokens": 256, **overrides}
    spec = make_engine(loaded, speculative="ngram", **settings)
    pin(spec.step_cost, 0.003, 0.0003)
    return make_engine(loaded, **settings), spec


def greedy(max_tokens: int = 64, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def accepted(engine: Any) -> int:
    return engine.stats().spec_accepted_tokens_total


def check_clean(engine: Any) -> None:
    assert not engine.has_work and engine.blocks.num_used_blocks == 0, "KV blocks leaked"


def test_greedy_is_token_for_token_the_same_batched_and_proposals_are_accepted(smollm2_q4_1: Loaded) -> None:
    tok = smollm2_q4_1.tokenizer
    prompts = {name: chat_ids(tok, text) for name, text in
               (("copy", COPY), ("edit", EDIT), ("code", CODE), ("open", OPEN))}
    plain, spec = engines(smollm2_q4_1)
    want = {n: tokens_of(run_all(plain, {n: (p, greedy(72))})[n]) for n, p in prompts.items()}
    alone = {}
    for name, prompt in prompts.items():
        before = spec.stats()
        alone[name] = tokens_of(run_all(spec, {name: (prompt, greedy(72))})[name])
        after = spec.stats()
        gained = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
        if name in ("copy", "edit"):  # input-grounded: most proposals pay (the 135M model rewrites the code)
            assert gained >= 10, f"{name}: only {gained} proposed tokens accepted"
            assert after.steps_total - before.steps_total < len(alone[name]), name
    assert alone == want
    # all four at once, then arriving while the others decode (continuous batching: prefills beside verifications)
    together = run_all(spec, {n: (p, greedy(72)) for n, p in prompts.items()})
    assert {n: tokens_of(o) for n, o in together.items()} == want
    names = list(prompts)
    spec.add_request(names[0], prompts[names[0]], greedy(72))
    outs: dict[str, list] = defaultdict(list)
    for step in range(10_000):
        if step in (3, 9, 15):
            name = names[(3, 9, 15).index(step) + 1]
            spec.add_request(name, prompts[name], greedy(72))
        if not spec.has_work and step > 15:
            break
        for out in spec.step():
            outs[out.request_id].append(out)
    assert {n: tokens_of(o) for n, o in outs.items()} == want
    check_clean(spec)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_verified_rows_are_the_same_bits_as_decoded_alone(smollm2_q4_1: Loaded, kv: str) -> None:
    """docs/determinism.md: a row's logits do not depend on its batch mates. A verification row (one of a chunk of
    a decode's last token and its proposals) gets the same bits as the decode step at that position; over an int8
    KV cache too, where a chunk of several rows reads the cache's rows from a widened copy and one row reads them
    as int8."""
    tok = smollm2_q4_1.tokenizer
    prompt = chat_ids(tok, COPY)
    plain, spec = engines(smollm2_q4_1, kv_cache_dtype=kv)

    def recorded(engine: Any) -> dict[tuple[int, ...], torch.Tensor]:
        rows: dict[tuple[int, ...], torch.Tensor] = {}  # the output before the row -> the row's logits
        sample = engine.sampler.sample

        def keep(logits: torch.Tensor, seqs: list, masks: Any = None) -> Any:
            for i, s in enumerate(seqs):
                rows[tuple(s.output_token_ids)] = logits[i].clone()
            return sample(logits, seqs, masks)

        engine.sampler.sample = keep
        return rows

    want, got = recorded(plain), recorded(spec)
    tokens = tokens_of(run_all(plain, {"r": (prompt, greedy(48))})["r"])
    assert tokens_of(run_all(spec, {"r": (prompt, greedy(48))})["r"]) == tokens
    assert accepted(spec) >= 10
    for n in range(len(tokens)):
        key = tuple(tokens[:n])
        assert torch.equal(got[key], want[key]), f"position {n} differs by {(got[key] - want[key]).abs().max()}"


def test_seeded_sampling_is_the_same_with_and_without_speculation(smollm2_q4_1: Loaded) -> None:
    """The sampler draws the token of output position p with the seeded generator's p-th number, however many
    rows asked for p: with speculation the kept tokens are those plain decoding draws, so a seeded request gives
    the same text either way (and run again), penalties and logprobs included."""
    tok = smollm2_q4_1.tokenizer
    prompts = {"copy": chat_ids(tok, COPY), "code": chat_ids(tok, CODE), "open": chat_ids(tok, OPEN)}
    kinds = {
        "t07": SamplingParams(temperature=0.7, seed=11, max_tokens=64, logprobs=2),
        "top": SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=5, max_tokens=64),
        "pen": SamplingParams(temperature=0.5, seed=3, max_tokens=64, repetition_penalty=1.1,
                              frequency_penalty=0.3, min_tokens=8, n=2),
    }
    plain, spec = engines(smollm2_q4_1)
    requests = {f"{p}-{k}": (prompts[p], params) for p in prompts for k, params in kinds.items()}
    want = run_all(plain, requests)
    got = run_all(spec, requests)
    again = run_all(spec, requests)
    for rid in requests:
        for index in range(requests[rid][1].n):
            assert tokens_of(got[rid], index) == tokens_of(want[rid], index), rid
            assert text_of(got[rid], index) == text_of(again[rid], index) == text_of(want[rid], index), rid
        if requests[rid][1].logprobs is not None:
            lp = [(x.token_id, x.logprob, [t.token_id for t in x.top]) for o in got[rid] for x in o.logprobs]
            lp_want = [(x.token_id, x.logprob, [t.token_id for t in x.top]) for o in want[rid] for x in o.logprobs]
            assert lp == lp_want and len(lp) == len(tokens_of(got[rid])), rid
    assert accepted(spec) >= 20
    check_clean(spec)


def test_stops_and_lengths_are_exact_inside_accepted_runs(smollm2_q4_1: Loaded) -> None:
    """A stop string, a stop token, EOS or max_tokens falling inside a run of accepted proposals ends the output
    exactly where plain decoding ends it (the tokens after are dropped)."""
    tok = smollm2_q4_1.tokenizer
    prompt = chat_ids(tok, COPY)
    plain, spec = engines(smollm2_q4_1)
    stop_token = tok.encode(" wick")[0]
    cases = {
        "stop": greedy(96, stop=("clockwork",)),
        "stop-incl": greedy(96, stop=("ninety steps",), include_stop_str_in_output=True),
        "stop-id": greedy(96, stop_token_ids=(stop_token,)),
        "len": greedy(37),
        "eos": greedy(200),  # the copy ends with the end-of-turn token, the model's EOS
        "logprobs": greedy(40, logprobs=3),
    }
    for name, params in cases.items():
        want = run_all(plain, {name: (prompt, params)})[name]
        got = run_all(spec, {name: (prompt, params)})[name]
        assert text_of(got) == text_of(want) and tokens_of(got) == tokens_of(want), name
        assert (got[-1].finish_reason, got[-1].stop_reason) == (want[-1].finish_reason, want[-1].stop_reason), name
        assert got[-1].completion_tokens == want[-1].completion_tokens == len(tokens_of(got)), name
    assert text_of(got).startswith("The lighthouse")
    logprobs = [x for o in got for x in o.logprobs or []]
    assert len(logprobs) == 40 and all(len(x.top) == 3 for x in logprobs)
    assert "clockwork" not in text_of(run_all(spec, {"s": (prompt, cases["stop"])})["s"])
    assert run_all(spec, {"l": (prompt, cases["len"])})["l"][-1].finish_reason == "length"
    assert accepted(spec) >= 30
    check_clean(spec)


def test_prefix_cache_holds_only_verified_tokens(smollm2_q4_1: Loaded) -> None:
    """Blocks written by verification chunks (rejected proposals' K/V included, later overwritten) are published
    only once every position in them holds an accepted token: a second turn whose prompt repeats the first turn's
    prompt and answer takes those blocks from the cache and answers as an engine without speculation or caching."""
    tok = smollm2_q4_1.tokenizer
    turn1 = chat_ids(tok, COPY)
    plain = make_engine(smollm2_q4_1, kv_cache_bytes=64 << 20, max_num_batched_tokens=256, prefix_caching=False)
    spec = make_engine(smollm2_q4_1, kv_cache_bytes=64 << 20, max_num_batched_tokens=256, speculative="ngram")
    pin(spec.step_cost, 0.003, 0.0003)
    answer = tokens_of(run_all(spec, {"t1": (turn1, greedy(60))})["t1"])
    assert answer == tokens_of(run_all(plain, {"t1": (turn1, greedy(60))})["t1"])
    assert accepted(spec) >= 10
    turn2 = turn1 + answer + tok.encode("<|im_end|>\n<|im_start|>user\nNow repeat it once more.<|im_end|>\n"
                                         "<|im_start|>assistant\n")
    got = run_all(spec, {"t2": (turn2, greedy(60))})["t2"]
    assert got[-1].cached_tokens >= (len(turn1) + len(answer) - 1) // 16 * 16 - 16 > len(turn1)
    assert tokens_of(got) == tokens_of(run_all(plain, {"t2": (turn2, greedy(60))})["t2"])
    again = run_all(spec, {"t1": (turn1, greedy(60))})["t1"]
    assert tokens_of(again) == answer and again[-1].cached_tokens > 0
    check_clean(spec)


def test_preemption_and_small_budgets_keep_the_answers(smollm2_q4_1: Loaded) -> None:
    """A KV cache too small for every sequence at once (preemptions, proposals cut to the blocks free) and a small
    step budget (proposals cut to what the decodes and prefill chunks leave)."""
    tok = smollm2_q4_1.tokenizer
    prompts = {f"r{i}": chat_ids(tok, text) for i, text in enumerate([COPY, EDIT, CODE, COPY, OPEN])}
    settings = {"kv_cache_bytes": 400 * 2 * 30 * 3 * 64 * 2, "max_num_batched_tokens": 32}  # ~400 tokens of float16 KV
    plain, spec = engines(smollm2_q4_1, **settings)
    params = greedy(64)
    want = run_all(plain, {r: (p, params) for r, p in prompts.items()})
    got = run_all(spec, {r: (p, params) for r, p in prompts.items()})
    assert {r: tokens_of(o) for r, o in got.items()} == {r: tokens_of(o) for r, o in want.items()}
    assert spec.stats().preemptions_total > 0 and accepted(spec) >= 10
    check_clean(spec)


def test_constrained_requests_propose_what_the_grammar_accepts_and_answer_the_same(smollm2_q4_1: Loaded) -> None:
    """A JSON-schema request extracting from its prompt speculates: its proposals are cut to what the grammar
    accepts, each verification row is masked with the grammar's state after the proposals before it, and the answer
    is plain constrained decoding's, greedy token for token and seeded number for number, alone and batched."""
    import json

    tok = smollm2_q4_1.tokenizer
    constraint = Constraint("json_schema", json.dumps(PERSON))
    prompt = chat_ids(tok, "Extract the person as JSON with the keys name and age: 'Ada Lovelace, aged 36, wrote "
                           "the first program.' Answer with the JSON only.")
    plain, spec = engines(smollm2_q4_1)
    for params in (greedy(60, constraint=constraint),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=60, constraint=constraint)):
        want = run_all(plain, {"j": (prompt, params)})["j"]
        before = spec.stats()
        alone = run_all(spec, {"j": (prompt, params)})["j"]
        after = spec.stats()
        assert tokens_of(alone) == tokens_of(want) and json.loads(text_of(alone))["age"] >= 0
        assert after.spec_proposed_tokens_total > before.spec_proposed_tokens_total  # the constrained one proposed
        batched = run_all(spec, {"j": (prompt, params), "free": (chat_ids(tok, COPY), greedy(40))})
        assert tokens_of(batched["j"]) == tokens_of(want)
    assert accepted(spec) > 0
    check_clean(spec)


def test_constrained_proposals_and_their_masks(smollm2_q4_1: Loaded) -> None:
    """The grammar's side: proposals cut at the first token the grammar refuses and before an EOS, nothing
    consumed by checking; each verification row's mask is the state's after the proposals before it (as plain
    decoding would compute it one token at a time), and the matcher is left as it was."""
    import json

    from engine.sampling import grammar

    tok = smollm2_q4_1.tokenizer
    state = grammar.GrammarState(Constraint("json_schema", json.dumps(PERSON)), tok)
    ids = tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    eos = frozenset({tok.eos_token_id})
    assert state.valid_prefix(ids, eos, []) == ids
    assert state.valid_prefix(ids[:3] + tok.encode("}}}", add_special_tokens=False), eos, []) == ids[:3]
    assert state.valid_prefix(ids[:2] + [tok.eos_token_id] + ids[2:], eos, []) == ids[:2]
    assert state.valid_prefix(ids + ids, eos, []) == ids  # the grammar ends with the object
    filler = grammar.BitmaskFiller(tok, len(tok), eos)
    one_by_one = []
    walker = grammar.GrammarState(state.constraint, tok)
    for i in range(5):
        one_by_one.append(filler.fill([(walker, [])]).clone())
        walker.sync(ids[: i + 1])
    free = grammar.GrammarState(Constraint("regex", "[a-z]+"), tok)

    def item(request_id: str, draft: list[int]) -> SimpleNamespace:  # a step's sampling item (ScheduledSeq)
        return SimpleNamespace(seq=SimpleNamespace(seq_id=(request_id, 0)), draft=tuple(draft))

    items = [item("u", []), item("c", ids[:4]), item("f", [])]  # rows: u; c and its 4 proposals; f
    indices, work = grammar.mask_work(items, {("c", 0): state, ("f", 0): free})
    assert indices == [1, 2, 3, 4, 5, 6] and [len(d) for _, d in work] == [4, 0]
    masks = filler.fill(work)
    for i in range(5):
        assert torch.equal(masks[i], one_by_one[i][0]), f"row {i}"
    assert state.valid_prefix(ids, eos, []) == ids and not state.done  # the matcher was rolled back


def test_lazy_constraints_propose_before_their_trigger_and_answer_the_same(smollm2_q4_1: Loaded) -> None:
    """A lazy constraint (a tool call's grammar waiting for its trigger) leaves the text free until the trigger, and
    its proposals are taken there too, up to the one that would complete the trigger; from the trigger on the
    grammar masks them. Copying the passage, the trigger "ninety" comes mid-copy and the regex ends the sequence at
    the sentence's full stop; a trigger never written leaves the whole copy free (it proposed nothing before).
    Greedy and seeded answers are plain decoding's, alone and batched."""
    tok = smollm2_q4_1.tokenizer
    prompt = chat_ids(tok, COPY)
    plain, spec = engines(smollm2_q4_1)
    for trigger in ("ninety", "<tool_call>"):
        constraint = Constraint("regex", "[ a-z,]+\\.", trigger=trigger)
        for params in (greedy(80, constraint=constraint),
                       SamplingParams(temperature=0.7, seed=3, max_tokens=80, constraint=constraint)):
            want = run_all(plain, {"l": (prompt, params)})["l"]
            before = accepted(spec)
            alone = run_all(spec, {"l": (prompt, params)})["l"]
            assert tokens_of(alone) == tokens_of(want), (trigger, params.temperature)
            if params.temperature == 0:
                assert accepted(spec) - before >= 10, trigger  # the free copy speculated
                text = text_of(want)
                if trigger == "ninety":
                    assert text.endswith("ninety steps, trimmed the wick and wound the clockwork that turned the lens.")
                    assert want[-1].finish_reason == "stop"  # the grammar ended it
            batched = run_all(spec, {"l": (prompt, params), "free": (chat_ids(tok, EDIT), greedy(40))})
            assert tokens_of(batched["l"]) == tokens_of(want)
    check_clean(spec)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_tiny_dense_model_greedy_and_seeded_are_the_same(tiny: Any, engine_factory: Any, kernels: bool) -> None:
    """Dense float32 weights: a step of decodes and verifications only goes through the one-call step (kernels on)
    or the op-by-op pass (kernels off); either way the answers are those of plain decoding. A step of so small a
    model is nearly all overhead, whose noise on a busy machine can fit a line as steep as the steps themselves
    (no proposal pays); its cost is pinned so that proposals pay here."""
    enc = tiny.tokenizer.encode
    prompts = {f"r{i}": enc(text) for i, text in enumerate(
        ["one two three four one two three four one two", "abc abc abc abc abc", "The quick brown fox " * 3,
         "Numbers: 0 1 2 3 0 1 2 3 0 1"])}
    settings = {"max_num_batched_tokens": 64, "cpu_kernels": kernels, "kv_cache_bytes": 8 << 20}
    plain = engine_factory(tiny, **settings)
    spec = engine_factory(tiny, speculative="ngram", **settings)
    pin(spec.step_cost, 0.002, 0.0001)
    for params in (greedy(40, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=21, max_tokens=40, ignore_eos=True)):
        requests = {r: (p, params) for r, p in prompts.items()}
        want = run_all(plain, requests)
        got = run_all(spec, requests)
        assert {r: tokens_of(o) for r, o in got.items()} == {r: tokens_of(o) for r, o in want.items()}
    assert spec.stats().spec_proposed_tokens_total > 0
