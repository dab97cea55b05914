"""Constrained decoding, unit level: masks against brute force on a tiny tokenizer, the grammar cache and its
limits, lazy triggers, the sampler's masking, and the wire fields -> Constraint mapping (app/chat/structured.py).

The masks are checked exactly: for a finite language L and the text p generated so far, a token t is allowed
if and only if some string of L starts with p + t, and EOS if and only if p is in L. One refinement, by
llguidance's design: where the grammar forces the next bytes, only the tokens of their canonical tokenization
are allowed (a non-empty subset of the valid ones).
"""

from __future__ import annotations

import json
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from app.chat.structured import constraint_of
from app.errors import BadRequestError
from engine.core.sequence import Sequence
from engine.sampling import grammar, grammar_text
from engine.sampling.grammar import BitmaskFiller, Constraint, GrammarError, GrammarState
from engine.sampling.sampler import MIN_LOGPROB, Sampler
from engine.types import SamplingParams


@pytest.fixture(scope="module")
def tok(byte_level_tokenizer):
    return byte_level_tokenizer


def token_bytes(tok, filler: BitmaskFiller) -> dict[int, bytes]:
    special = set(tok.all_special_ids)
    return {t: filler.lltok.decode_bytes([t]) for t in range(len(tok)) if t not in special}


def walk_exact(tok, constraint: Constraint, language: set[str], seed: int, extra_vocab: int = 0) -> str:
    """Generate by picking random allowed tokens; at every step the mask must equal the brute-force set."""
    eos = tok.eos_token_id
    filler = BitmaskFiller(tok, len(tok) + extra_vocab, frozenset({eos}))
    pieces = token_bytes(tok, filler)
    words = {w.encode() for w in language}
    state = GrammarState(constraint, tok)
    rng = random.Random(seed)
    out: list[int] = []
    text = b""
    for _ in range(64):
        if state.done:
            break
        allowed = filler.allowed(filler.fill([(state, [])]))[0]
        assert allowed.shape == (len(tok) + extra_vocab,)
        expected = {t for t, b in pieces.items() if b and any(w.startswith(text + b) for w in words)}
        got = set(allowed.nonzero().flatten().tolist())
        forced = _forced(text, words)
        if forced:  # llguidance keeps forced bytes in their canonical tokenization: a subset, with that token
            assert got - {eos} <= expected and filler.lltok.tokenize_bytes(forced)[0] in got, (text, got)
        else:
            assert got - {eos} == expected, (text, sorted(got ^ expected)[:10])
        assert (eos in got) == (text in words)
        assert not allowed[len(tok):].any(), "tokens past the tokenizer's vocabulary are never allowed"
        choice = rng.choice(sorted(got))
        if choice == eos:
            break
        out.append(choice)
        text += pieces[choice]
        state.sync(out, frozenset({eos}))
    assert text.decode() in language
    return text.decode()


def _forced(text: bytes, words: set[bytes]) -> bytes:
    """The bytes every word continuing `text` has next (none when `text` may end here)."""
    rest = [w[len(text):] for w in words if w.startswith(text)]
    if not rest or b"" in rest:
        return b""
    n = 0
    while all(len(r) > n and r[n] == rest[0][n] for r in rest):
        n += 1
    return rest[0][:n]


@pytest.mark.parametrize(
    ("constraint", "language"),
    [
        (Constraint("choice", json.dumps(["yes", "no", "maybe", "yesterday"])), {"yes", "no", "maybe", "yesterday"}),
        (Constraint("regex", r"(ab|cd)\d"), {f"{p}{d}" for p in ("ab", "cd") for d in range(10)}),
        (Constraint("regex", "[ab]{1,3}"), {"".join(x) for n in (1, 2, 3) for x in __import__("itertools").product("ab", repeat=n)}),
        (Constraint("json_schema", json.dumps({"type": "boolean"})), {"true", "false"}),
        (Constraint("json_schema", json.dumps({"enum": ["red", "green", 7]})), {'"red"', '"green"', "7"}),
        (Constraint("json_schema", json.dumps({
            "type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
            "required": ["ok", "n"], "additionalProperties": False})),
         {f'{{"ok": {b}, "n": {n}}}' for b in ("true", "false") for n in (1, 2)}),
        (Constraint("gbnf", 'root ::= "x" [0-2] ("!" | "")'), {f"x{d}{e}" for d in "012" for e in ("", "!")}),
        (Constraint("lark", 'start: "a" ("b" | "cd")'), {"ab", "acd"}),
    ],
    ids=["choice", "regex", "regex-rep", "bool", "enum", "object", "gbnf", "lark"],
)
def test_masks_allow_exactly_the_valid_continuations(tok, constraint, language):
    seen = {walk_exact(tok, constraint, language, seed, extra_vocab=5) for seed in range(12)}
    assert seen <= language


def test_regex_digit_and_word_classes_are_ascii():
    assert grammar_text.ascii_classes(r"\d{3}-\w+") == "[0-9]{3}-[0-9A-Za-z_]+"
    assert grammar_text.ascii_classes(r"[\d_]\D\W") == "[0-9_][^0-9][^0-9A-Za-z_]"
    assert grammar_text.ascii_classes(r"a\\d\.\p{L}") == r"a\\d\.\p{L}"
    assert grammar_text.ascii_classes(r"[\]\d]\d") == r"[\]0-9][0-9]"


def test_regex_digits_exclude_other_scripts(tok):
    state = GrammarState(Constraint("regex", r"\d"), tok)
    lltok = grammar.ll_tokenizer(tok)
    assert state.matcher.try_consume_tokens(lltok.tokenize_str("\u0661")) == 0  # ARABIC-INDIC DIGIT ONE
    assert state.matcher.try_consume_tokens(lltok.tokenize_str("7")) == 1


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("regex", "(("), "invalid regex"),
        (Constraint("json_schema", '{"type": "bogus"}'), "invalid json_schema"),
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "must be an object"),
        (Constraint("choice", "[]"), "non-empty list"),
        (Constraint("gbnf", "root ::= ("), "invalid gbnf"),
        (Constraint("lark", "start: undefined_rule"), "invalid lark"),
        (Constraint("regex", "a" * (grammar_text.MAX_GRAMMAR_CHARS + 1)), "the limit is"),
        (Constraint("json_schema", '{"items":' * 40 + "{}" + "}" * 40), "nested"),
        (Constraint("json_schema", "[" * 100_000 + "]" * 100_000), "characters long"),
        (Constraint("regex", "a", trigger=""), "trigger"),
    ],
)
def test_rejected_constraints_raise_grammar_error(tok, constraint, message):
    with pytest.raises(GrammarError, match=message):
        grammar.validate(constraint, tok)


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
        Constraint("json_schema", json.dumps({"allOf": [{"type": "string"}, {"type": "integer"}]})),
        Constraint("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 3})),
        Constraint("gbnf", "root ::= root"),
        Constraint("lark", 'start: a\na: a "x"'),
    ],
    ids=["self-ref", "contradictory", "empty-range", "gbnf-loop", "lark-loop"],
)
def test_grammars_that_admit_no_text_are_rejected(tok, constraint):
    with pytest.raises(GrammarError, match="admits no text|Unsatisfiable"):
        grammar.validate(constraint, tok)


def test_a_slow_compile_is_an_error_in_bounded_time(tok, monkeypatch):
    """The caller waits COMPILE_TIMEOUT_S at most, not for the compile (itself also bounded by llguidance's fuel):
    the error comes while the compile is still held back (no wall-clock bound, which a busy machine could break)."""
    real = grammar._compile
    release, finished = threading.Event(), threading.Event()

    def slow(constraint, lltok):
        release.wait(120)
        try:
            return real(constraint, lltok)
        finally:
            finished.set()

    monkeypatch.setattr(grammar, "_compile", slow)
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(GrammarError, match="to compile"):
            grammar.compiled(Constraint("regex", "slow[0-9]"), tok, timeout=0.2)
        assert not finished.is_set()  # the caller gave up while the compile was still running
    finally:
        release.set()
    assert finished.wait(60)


def test_compiled_grammars_are_cached(tok):
    c = Constraint("json_schema", json.dumps({"type": "object", "properties": {"cached": {"type": "integer"}}}))
    first = grammar.compiled(c, tok)
    assert grammar.compiled(c, tok) is first
    a, b = GrammarState(c, tok), GrammarState(c, tok)
    assert a.matcher is not b.matcher  # each sequence has its own matcher state


def test_a_refused_grammar_is_not_compiled_again(tok, monkeypatch):
    calls = []
    real = grammar._compile
    monkeypatch.setattr(grammar, "_compile", lambda c, lltok: calls.append(c) or real(c, lltok))
    bad = Constraint("regex", "(((refused")
    for _ in range(3):
        with pytest.raises(GrammarError, match="invalid regex"):
            grammar.validate(bad, tok)
    assert len(calls) == 1


def test_cache_is_bounded(tok, monkeypatch):
    monkeypatch.setattr(grammar, "CACHE", grammar._Cache(3))
    for i in range(6):
        grammar.validate(Constraint("regex", f"x{i}"), tok)
    assert len(grammar.CACHE) == 3


def test_lazy_trigger_constrains_only_after_it(tok):
    eos = frozenset({tok.eos_token_id})
    state = GrammarState(Constraint("regex", "[0-9]+;", trigger="fox"), tok)
    ids = tok.encode("The quick brown", add_special_tokens=False)
    state.sync(ids, eos)
    assert not state.active and not state.done  # free text
    ids = ids + tok.encode(" fox", add_special_tokens=False)
    state.sync(ids, eos)
    assert state.active
    ids = ids + tok.encode("12;", add_special_tokens=False)
    state.sync(ids, eos)
    assert state.done and not state.failed


def test_lazy_trigger_feeds_the_text_after_it(tok):
    """A token that carries the trigger and more: the text after the trigger is fed to the matcher."""
    eos = frozenset({tok.eos_token_id})
    state = GrammarState(Constraint("regex", "[0-9]+;", trigger="fox"), tok)
    state.sync(tok.encode("a fox12", add_special_tokens=False), eos)
    assert state.active
    filler = BitmaskFiller(tok, len(tok), eos)
    allowed = filler.allowed(filler.fill([(state, [])]))[0]
    assert allowed[tok.convert_tokens_to_ids(";")]
    assert not allowed[tok.convert_tokens_to_ids("a")]


def test_lazy_trigger_proposals_stop_before_the_one_completing_it(tok):
    """Speculative proposals before a lazy trigger are free text: all kept, up to the one whose text completes the
    trigger (also when the trigger starts in the output already); after it, the grammar's rules."""
    eos = frozenset({tok.eos_token_id})
    state = GrammarState(Constraint("regex", "[0-9]+;", trigger="fox"), tok)
    out = tok.encode("The quick", add_special_tokens=False)
    state.sync(out, eos)
    free = tok.encode(" brown dog jumps over", add_special_tokens=False)
    assert state.valid_prefix(free, eos, out) == free
    draft = tok.encode(" brown fox12; and more", add_special_tokens=False)
    at = next(i for i in range(len(draft)) if "fox" in tok.decode(draft[: i + 1]))
    assert at >= 1 and state.valid_prefix(draft, eos, out) == draft[:at]
    state.sync(out + draft[: at + 1], eos)
    assert state.active
    digits = tok.encode("12; and", add_special_tokens=False)
    assert 1 <= len(state.valid_prefix(digits, eos, out + draft[: at + 1])) < len(digits)
    split = tok.encode("The quick brown f", add_special_tokens=False)
    state = GrammarState(Constraint("regex", "[0-9]+;", trigger="fox"), tok)
    state.sync(split, eos)
    assert state.valid_prefix(tok.encode("ox jumps", add_special_tokens=False), eos, split) == []


def test_eos_ids_of_the_model_follow_the_tokenizers(tok):
    other_eos = 3  # <|im_start|> stands in for a second EOS id from generation_config
    filler = BitmaskFiller(tok, len(tok), frozenset({tok.eos_token_id, other_eos}))
    state = GrammarState(Constraint("choice", '["no"]'), tok)
    allowed = filler.allowed(filler.fill([(state, [])]))[0]
    assert not allowed[other_eos] and not allowed[tok.eos_token_id]
    state = GrammarState(Constraint("regex", "n(o)*"), tok)
    state.sync(tok.encode("no", add_special_tokens=False))
    allowed = filler.allowed(filler.fill([(state, [])]))[0]
    assert allowed[other_eos] and allowed[tok.eos_token_id]


def _seq(params: SamplingParams, index: int = 0) -> Sequence:
    return Sequence(f"r{index}", index, [1, 2, 3], params, 16)


def test_sampler_masks_only_the_constrained_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seqs = [_seq(SamplingParams(temperature=0.7, seed=5 + i, logprobs=3), i) for i in range(3)]
    allowed = torch.zeros(1, 50, dtype=torch.bool)
    allowed[0, [7, 11]] = True
    free = Sampler(torch.device("cpu"), 0, [0]).sample(logits.clone(), seqs)
    masked = Sampler(torch.device("cpu"), 0, [0]).sample(logits.clone(), seqs, ([1], ~allowed))
    assert masked[0] == free[0] and masked[2] == free[2]  # free rows: same tokens, same logprobs
    assert masked[1].token_id in (7, 11)
    # logprobs are those of the masked distribution: the two allowed tokens share all the mass
    probs = torch.softmax(logits[1, [7, 11]], dim=0)
    assert pytest.approx(masked[1].logprob, abs=1e-5) == float(torch.log(probs[[7, 11].index(masked[1].token_id)]))
    assert [t for t, _ in masked[1].top[:2]] in ([7, 11], [11, 7])
    assert masked[1].top[2][1] == MIN_LOGPROB  # a forbidden alternative: finite, JSON-safe


def test_sampler_min_tokens_never_empties_a_constrained_row():
    logits = torch.randn(1, 20)
    allowed = torch.zeros(1, 20, dtype=torch.bool)
    allowed[0, 0] = True  # only EOS (id 0) is allowed, and min_tokens forbids it
    seq = _seq(SamplingParams(temperature=0, min_tokens=5))
    assert Sampler(torch.device("cpu"), 0, [0]).sample(logits, [seq], ([0], ~allowed))[0].token_id == 0


# ---------------------------------------------------------------- wire fields -> Constraint


def req(**fields):
    names = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "grammar", "json_schema")
    return SimpleNamespace(**{n: fields.get(n) for n in names})


SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object", "")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, Constraint("json_object", "")),
        ({"response_format": {"type": "json_object", "schema": SCHEMA}},
         Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
         Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, Constraint("regex", "a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, Constraint("choice", '["x", "y"]')),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Constraint("gbnf", 'root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, Constraint("json_object", "")),
        ({"guided_json": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
        ({"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
        ({"guided_choice": ["a", "b"]}, Constraint("choice", '["a", "b"]')),
        ({"guided_grammar": 'root ::= "a"'}, Constraint("gbnf", 'root ::= "a"')),
        ({"grammar": 'root ::= "a"'}, Constraint("gbnf", 'root ::= "a"')),
        ({"json_schema": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
        ({"response_format": {"type": "text"}, "guided_regex": "a"}, Constraint("regex", "a")),
    ],
)
def test_wire_fields_map_to_one_constraint(fields, expected):
    assert constraint_of(req(**fields)) == expected


def test_schema_key_order_is_kept():
    """Properties come out in the order the schema lists them, so the text is not reordered by a cache key."""
    c = constraint_of(req(guided_json=SCHEMA))
    assert list(json.loads(c.value)["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "json_schema": {"type": "object"}}, "json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": "a"}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_json": "{nope"}, "guided_json"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
    ],
)
def test_bad_wire_fields_are_400s_naming_the_field(fields, param):
    with pytest.raises(BadRequestError) as info:
        constraint_of(req(**fields))
    assert info.value.param == param
