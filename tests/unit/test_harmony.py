"""gpt-oss's harmony format (app/chat/harmony.py): channels split into reasoning, content and tool calls, whole and
streamed in any chunking, then read by the `harmony` tool format; its grammars checked with llguidance (quoted
markers, and markers that are special tokens as in gpt-oss's vocabulary); the chat plan keeping special tokens
and stopping on `<|call|>` / `<|return|>`; the reasoning parser picked from the template. The real template's
round trip is in test_chat_templates.py, a served forced call in tests/api/test_chat_templates_api.py."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import llguidance
import llguidance.hf
import pytest

from app.chat import harmony, reasoning
from app.chat.plan import PlanRequest, build_plan
from app.chat.tool_parsers import FORMATS, parse
from app.chat.tools import NamedChoice, plan_for
from app.openai.schemas import ChatMessage
from app.openai.tools import split_chunks as tool_chunks
from engine.types import SamplingParams
from models.chat_templates import named
from tests.support import build_byte_level_tokenizer

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NAMES = frozenset({"get_weather"})
CALL = {"city": "Paris"}

# what gpt-oss writes after the prompt's `<|start|>assistant` -> (reasoning, content, the call or None)
OUTPUTS = {
    "answer": ("<|channel|>analysis<|message|>The user wants a greeting.<|end|><|start|>assistant<|channel|>final"
               "<|message|>Hello! How can I help?", "The user wants a greeting.", "Hello! How can I help?", None),
    "call": ('<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary '
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
             "Need the weather tool.", "", CALL),
    "recipient in the role header": (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                                     "<|call|>", "", "", CALL),
    "preamble, then a call": ('<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant'
                              '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                              '{"city": "Paris"}', "", "Checking the weather.", CALL),
    "final only, with its end": ("<|channel|>final<|message|>Done.<|return|>", "", "Done.", None),
    "not harmony": ("Plain text, to the point <| not a marker.", "", "Plain text, to the point <| not a marker.", None),
    "a header never finished": ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|chan", "Hmm.", "",
                                None),
}  # fmt: skip


def chunked(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("case", sorted(OUTPUTS))
@pytest.mark.parametrize("seed", range(4))
def test_channels_split_the_same_whole_and_streamed(case: str, seed: int) -> None:
    text, want_reasoning, want_content, call = OUTPUTS[case]
    got_reasoning, got_content = harmony.split(text)
    if call is None:
        assert (got_reasoning, got_content) == (want_reasoning, want_content)
    else:
        assert got_reasoning == want_reasoning
        content, calls = parse(FORMATS["harmony"], got_content, NAMES)
        assert content == want_content and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", call)]
    splitter = harmony.HarmonySplitter()
    pieces = [splitter.feed(p) for p in chunked(text, seed)] + [splitter.flush()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (got_reasoning, got_content)
    assert not any("<|" in r for r, _ in pieces)  # no marker ever leaks into reasoning


def test_streamed_chunks_give_reasoning_then_a_tool_call_delta() -> None:
    """The two layers every chat route stacks (reasoning, then tools) on a harmony stream."""
    text = OUTPUTS["call"][0]

    async def events():
        yield {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        pieces = chunked(text, 7)
        for i, piece in enumerate(pieces):
            yield {"choices": [{"index": 0, "delta": {"content": piece},
                                "finish_reason": "stop" if i == len(pieces) - 1 else None}]}

    tokenizer = build_byte_level_tokenizer()
    tokenizer.chat_template = named("gpt-oss")
    new_splitter = reasoning.splitter_factory("auto", tokenizer, [])
    assert new_splitter is harmony.HarmonySplitter
    tool_plan = plan_for([WEATHER], "auto", True, tokenizer)

    async def collect() -> list[dict[str, Any]]:
        return [e async for e in tool_chunks(reasoning.split_chunks(events(), new_splitter), tool_plan.new_stream)]

    out = asyncio.run(collect())
    deltas = [c["delta"] for e in out for c in e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather tool."
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == CALL
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_parser_is_picked_from_the_template() -> None:
    tokenizer = build_byte_level_tokenizer()
    tokenizer.chat_template = named("gpt-oss")
    assert harmony.is_harmony(tokenizer.chat_template) and not harmony.is_harmony(named("qwen3"))
    assert plan_for([WEATHER], "auto", True, tokenizer).fmt.name == "harmony"
    assert reasoning.splitter_factory("none", tokenizer, []) is None
    qwen = build_byte_level_tokenizer()
    qwen.chat_template = named("qwen3")
    assert reasoning.splitter_factory("gpt_oss", qwen, []) is harmony.HarmonySplitter  # forced by the setting


# ---------------------------------------------------------------- grammars


def harmony_tokenizer(special: bool) -> Any:
    """The test tokenizer, with gpt-oss's markers as special tokens (its real vocabulary) or as plain text."""
    from transformers import AddedToken

    tokenizer = build_byte_level_tokenizer()
    if special:
        markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>"]
        tokenizer.add_tokens([AddedToken(m, special=True) for m in markers], special_tokens=True)
    tokenizer.chat_template = named("gpt-oss")
    return tokenizer


def accepts(tokenizer: Any, lark: str, text: str) -> bool:
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.grammar_from("lark", lark)
    assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""
    matcher = llguidance.LLMatcher(lltok, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("special", [False, True])
def test_a_forced_call_is_the_harmony_header_and_valid_arguments(special: bool) -> None:
    tokenizer = harmony_tokenizer(special)
    lark = plan_for([WEATHER], NamedChoice("get_weather"), True, tokenizer).constraint.value
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert accepts(tokenizer, lark, call)
    assert not accepts(tokenizer, lark, call.replace("get_weather", "get_wether"))
    assert not accepts(tokenizer, lark, call.replace('"Paris"', "3"))
    assert ("<[" in lark) is special  # a marker that is one token is written as that token


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("after", [' <|constrain|>json<|message|>{"city": "Paris"}',
                                   '<|channel|>commentary json<|message|>{"city": "Paris"}'])
def test_the_lazy_grammar_takes_either_header_order_after_its_trigger(special: bool, after: str) -> None:
    tokenizer = harmony_tokenizer(special)
    constraint = plan_for([WEATHER], "auto", True, tokenizer).constraint
    assert constraint.trigger == "to=functions."
    assert accepts(tokenizer, constraint.value, "get_weather" + after)


@pytest.mark.parametrize("special", [False, True])
def test_a_harmony_chat_keeps_special_tokens_and_stops_at_call_and_return(special: bool) -> None:
    tokenizer = harmony_tokenizer(special)
    messages = [[ChatMessage(role="user", content="Hi")]]
    plan = asyncio.run(build_plan(tokenizer, PlanRequest(params=SamplingParams(), conversations=messages)))
    assert plan.params.skip_special_tokens is False
    stops = {tokenizer.convert_tokens_to_ids(t) for t in ("<|call|>", "<|return|>")} if special else set()
    assert set(plan.params.stop_token_ids) == stops
    text = tokenizer.decode(plan.prompts[0], skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>user<|message|>Hi<|end|>"
                                                                          "<|start|>assistant")
    completion = asyncio.run(build_plan(tokenizer, PlanRequest(params=SamplingParams(), prompt_ids=[[1, 2]])))
    assert completion.params.skip_special_tokens is True  # completions stay as they were


def test_apis_without_a_reasoning_field_get_the_content_only() -> None:
    """The legacy Llama Stack routes: per choice, the final channel (and a call in the form the tool parser reads)."""
    from engine.types import RequestOutput

    def outputs(text: str, index: int) -> list[tuple[int, RequestOutput]]:
        pieces = chunked(text, index)
        return [(0, RequestOutput("r", index, piece, [], 3, i + 1, "stop" if i == len(pieces) - 1 else None))
                for i, piece in enumerate(pieces)]

    async def collect() -> dict[int, str]:
        async def source():
            for pair in outputs(OUTPUTS["answer"][0], 0) + outputs(OUTPUTS["call"][0], 1):
                yield pair

        texts: dict[int, str] = {}
        async for _, out in harmony.content_only(source()):
            texts[out.index] = texts.get(out.index, "") + out.text
        return texts

    texts = asyncio.run(collect())
    assert texts[0] == "Hello! How can I help?"
    assert parse(FORMATS["harmony"], texts[1], NAMES)[1][0].name == "get_weather"
