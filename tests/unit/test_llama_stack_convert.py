"""The legacy Llama Stack converter and the per-request stream format rule, without a model."""

from __future__ import annotations

import json
import types

import pytest
from starlette.requests import Request

from app.errors import BadRequestError
from app.llama_stack import convert as conv
from app.llama_stack.schemas import ChatCompletionRequest, CompletionRequest, ContentItem
from app.streaming import NDJSON, SSE, SSE_NO_DONE, stream_format
from engine.types import Constraint, RequestOutput, TokenLogprob, TopLogprob


def params(sampling: dict, **extra):
    body = {"model_id": "m", "content": "x", "sampling_params": sampling, **extra}
    return conv.to_sampling_params(CompletionRequest.model_validate(body))


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({}, (0.0, 1.0, 0)),
        ({"strategy": {"type": "greedy"}}, (0.0, 1.0, 0)),
        ({"strategy": {"type": "top_p", "temperature": 0.7, "top_p": 0.9}}, (0.7, 0.9, 0)),
        ({"strategy": {"type": "top_p"}}, (1.0, 0.95, 0)),
        ({"strategy": {"type": "top_k", "top_k": 5}}, (1.0, 1.0, 5)),
        # 0.0.x: a bare strategy name, the numbers beside it
        ({"strategy": "greedy", "temperature": 0.9, "top_p": 0.5}, (0.0, 1.0, 0)),
        ({"strategy": "top_p", "temperature": 0.6, "top_p": 0.8, "top_k": 3}, (0.6, 0.8, 0)),
        ({"strategy": "top_k", "temperature": 0.5, "top_k": 7}, (0.5, 1.0, 7)),
    ],
)
def test_both_strategy_shapes(sampling: dict, expected: tuple) -> None:
    p = params(sampling)
    assert (p.temperature, p.top_p, p.top_k) == expected


def test_limits_stops_penalty_and_logprobs_carry_over() -> None:
    p = params({"max_tokens": 0, "repetition_penalty": 1.2, "stop": ["\n", ""]}, logprobs={"top_k": 2})
    assert p.max_tokens is None  # 0: the server's default, the rest of the context
    assert (p.repetition_penalty, p.stop, p.logprobs) == (1.2, ("\n",), 2)
    assert params({"max_tokens": 12}).max_tokens == 12
    assert params({}).logprobs is None


def test_response_format_becomes_a_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = params({}, response_format={"type": "json_schema", "json_schema": schema})
    assert p.constraint == Constraint("json_schema", json.dumps(schema, separators=(",", ":")))  # as every family
    p = params({}, response_format={"type": "grammar", "bnf": 'root ::= "yes" | "no"'})
    assert p.constraint == Constraint("gbnf", 'root ::= "yes" | "no"')
    assert params({}).constraint is None
    for fmt, param in [({"type": "regex", "regex": "a+"}, "response_format.type"),
                       ({"type": "grammar", "bnf": {}}, "response_format.bnf"),
                       ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema")]:
        with pytest.raises(BadRequestError) as err:
            params({}, response_format=fmt)
        assert err.value.param == param


def test_content_shapes() -> None:
    assert conv.content_text("hi", "c") == "hi"
    assert conv.content_text(ContentItem(type="text", text="hi"), "c") == "hi"
    req = CompletionRequest.model_validate({"content": ["a", {"type": "text", "text": "b"}]})
    assert conv.content_text(req.content, "content") == "a b"
    image = CompletionRequest.model_validate({"content": [{"type": "image", "image": {"url": "x"}}]})
    with pytest.raises(BadRequestError, match="image"):
        conv.content_text(image.content, "content")


def test_messages_with_tool_results_in_both_eras() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {
                    "role": "assistant",
                    "content": "",
                    "stop_reason": "end_of_message",
                    "tool_calls": [
                        {"call_id": "c1", "tool_name": "get_weather", "arguments": {"city": "Oslo"}}
                    ],
                },
                {"role": "tool", "call_id": "c1", "tool_name": "get_weather", "content": "rain"},
                {
                    "role": "ipython",
                    "call_id": "c2",
                    "tool_name": "brave_search",
                    "content": {"type": "text", "text": "sun"},
                },
            ],
        }
    )
    msgs = conv.chat_messages(req.messages)
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[1].content == "weather?"
    call = msgs[2].tool_calls[0]
    assert call["id"] == "c1" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert (msgs[3].tool_call_id, msgs[3].content) == ("c1", "rain")
    assert (msgs[4].tool_call_id, msgs[4].content, msgs[4].name) == ("c2", "sun", "brave_search")


def out(text: str, finish=None, n: int = 1, logprobs=None) -> tuple[int, RequestOutput]:
    return 0, RequestOutput("r", 0, text, [1], 5, n, finish_reason=finish, logprobs=logprobs)


async def agen(items):
    for item in items:
        yield item


@pytest.mark.parametrize(("style", "delta"), [("typed", {"type": "text", "text": "He"}), ("bare", "He")])
async def test_chat_stream_events(style: conv.DeltaStyle, delta) -> None:
    events = [e async for e in conv.chat_events(agen([out("He"), out("llo", "length", 2)]), style, False)]
    kinds = [e["event"]["event_type"] for e in events]
    assert kinds == ["start", "progress", "progress", "complete"]
    assert events[1]["event"]["delta"] == delta
    assert events[-1]["event"]["stop_reason"] == "out_of_tokens"
    assert {m["metric"]: m["value"] for m in events[-1]["metrics"]}["total_tokens"] == 7


async def test_non_stream_fold_and_logprobs() -> None:
    lp = [TokenLogprob(7, "Hi", -0.1, top=(TopLogprob(8, "Yo", -2.0),))]
    folds = await conv.fold_outputs(agen([out("Hi", "stop", logprobs=lp)]), 1, True)
    chat = folds[0].chat_response()
    assert chat["completion_message"] == {
        "role": "assistant",
        "content": "Hi",
        "stop_reason": "end_of_turn",
        "tool_calls": [],
    }
    assert chat["logprobs"] == [{"logprobs_by_token": {"Hi": -0.1, "Yo": -2.0}}]
    assert folds[0].completion_response()["content"] == "Hi"


def make_request(
    query: str = "", headers: dict[str, str] | None = None, setting: str | None = None
) -> Request:
    settings = types.SimpleNamespace(stream_done_marker=setting) if setting else types.SimpleNamespace()
    app = types.SimpleNamespace(state=types.SimpleNamespace(settings=settings))
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "query_string": query.encode(), "headers": raw, "app": app})


@pytest.mark.parametrize(
    ("query", "headers", "setting", "openai", "expected"),
    [
        ("", {}, None, True, SSE),
        ("", {}, None, False, SSE_NO_DONE),
        ("", {"X-LlamaStack-Client-Version": "0.6.0"}, None, True, SSE_NO_DONE),
        ("", {"X-LlamaStack-Client-Version": "0.5.2"}, None, True, SSE_NO_DONE),
        ("", {"X-LlamaStack-Client-Version": "0.6.1"}, None, True, SSE),
        ("", {"X-LlamaStack-Client-Version": "0.7.5"}, None, True, SSE),
        ("", {"X-LlamaStack-Client-Version": "garbage"}, None, True, SSE),
        ("", {}, "never", True, SSE_NO_DONE),
        ("", {}, "always", False, SSE),
        ("done=false", {}, "always", True, SSE_NO_DONE),
        ("", {"X-Peregrine-Done": "true", "X-LlamaStack-Client-Version": "0.6.0"}, None, True, SSE),
        ("format=ndjson", {}, None, True, NDJSON),
        ("", {"Accept": "application/x-ndjson"}, None, False, NDJSON),
        ("format=sse", {"Accept": "application/x-ndjson"}, None, True, SSE),
    ],
)
def test_stream_format_rule(query, headers, setting, openai, expected) -> None:
    assert stream_format(make_request(query, headers, setting), openai=openai) == expected
