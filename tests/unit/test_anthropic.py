"""The Messages API's converter, event renderer and error envelope, without a model: the request -> chat-form
conversion, chat chunks -> Anthropic events (thinking, text, tool_use blocks; stop reasons), and the shared
layers' errors (auth with x-api-key, body size, rate limit, model still loading) in Anthropic's envelope."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from app.anthropic.convert import Finish, to_chat_request
from app.anthropic.events import AnthropicSSE, message_events
from app.anthropic.schemas import MessagesRequest
from app.errors import BadRequestError
from app.server import create_app

TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object", "properties": {}}}


def _request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})


def test_conversation_becomes_the_chat_form() -> None:
    chat = to_chat_request(_request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                         {"type": "text", "text": "Thanks."}]},
            {"role": "system", "content": "Mid-conversation note."},
        ],
        stop_sequences=["\n\n"], temperature=0, top_k=5, metadata={"user_id": "u"},
    ))  # fmt: skip
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user", "system"]
    assert chat.messages[0].content == "Be brief."
    call = chat.messages[2].tool_calls[0]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "sunny"
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k) == (8, ["\n\n"], 0, 5)
    assert chat.tools[0].function.parameters == TOOL["input_schema"]


@pytest.mark.parametrize(("choice", "expected"), [("auto", "auto"), ("any", "required"), ("none", "none")])
def test_tool_choice_kinds(choice: str, expected: str) -> None:
    chat = to_chat_request(_request(tools=[TOOL], tool_choice={"type": choice},
                                    messages=[{"role": "user", "content": "hi"}]))
    assert chat.tool_choice == expected


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
         "toolu_x"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
         "text only"),
        ({"messages": [{"role": "user", "content": "hi"}],
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}}, "requires tools"),
    ],
    ids=["unknown-tool-use-id", "image", "server-tool", "any-without-tools"],
)
def test_what_cannot_be_served_is_a_400(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(BadRequestError) as info:
        to_chat_request(_request(**fields))
    assert words in info.value.message


def test_unknown_block_type_names_it() -> None:
    with pytest.raises(ValueError, match="'document'"):
        _request(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])


async def _chunks(deltas: list[dict[str, Any]], finish_reason: str) -> Any:
    for delta in deltas:
        yield {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    yield {"choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]}
    yield {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4,
                                    "prompt_tokens_details": {"cached_tokens": 6}}}


async def _events(deltas: list[dict[str, Any]], finish_reason: str, finish: Finish | None = None,
                  stops: list[str] | None = None) -> list[dict[str, Any]]:
    gen = message_events(_chunks(deltas, finish_reason), id="msg_1", model="m", prompt_tokens=10,
                         finish=finish or Finish(), stop_sequences=stops)
    return [event async for event in gen]


async def test_blocks_stream_in_order_with_their_deltas() -> None:
    events = await _events([
        {"reasoning_content": "think"}, {"content": "Hello"}, {"content": " there"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1}"}}]},
    ], "tool_calls")  # fmt: skip
    types = [e["type"] for e in events]
    assert types == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"] and starts[2]["name"] == "f"
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["thinking_delta", "text_delta", "text_delta", "input_json_delta"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    end = events[-2]
    assert end["delta"]["stop_reason"] == "tool_use"
    assert end["usage"] == {"input_tokens": 4, "output_tokens": 4, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 6}


@pytest.mark.parametrize(
    ("finish_reason", "stop_string", "expected", "sequence"),
    [("stop", None, "end_turn", None), ("length", None, "max_tokens", None), ("stop", "END", "stop_sequence", "END")],
)
async def test_stop_reasons(finish_reason: str, stop_string: str | None, expected: str, sequence: str | None) -> None:
    events = await _events([{"content": "x"}], finish_reason, Finish(finish_reason, stop_string), ["END"])
    assert events[-2]["delta"] == {"stop_reason": expected, "stop_sequence": sequence}


def test_sse_framing_names_the_event_and_turns_errors_into_error_events() -> None:
    sse = AnthropicSSE()
    assert sse.encode({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    error = sse.encode({"error": {"message": "boom", "type": "internal_server_error"}}).decode()
    assert error.startswith("event: error\n")
    assert json.loads(error.split("data: ", 1)[1]) == {"type": "error", "error": {"type": "api_error",
                                                                                  "message": "boom"}}


def _app(**settings: Any) -> httpx.AsyncClient:
    app = create_app(engine=None, settings=SimpleNamespace(host="127.0.0.1", **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


BODY = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _anthropic_error(r: httpx.Response, status: int, error_type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type and body["error"]["message"]
    assert body["request_id"] == r.headers["request-id"] == r.headers["x-request-id"]
    return body["error"]["message"]


async def test_auth_takes_x_api_key_and_answers_in_anthropics_envelope() -> None:
    async with _app(api_key_list=("sk-good",)) as client:
        _anthropic_error(await client.post("/v1/messages", json=BODY), 401, "authentication_error")
        r = await client.post("/v1/messages", json=BODY, headers={"x-api-key": "sk-bad"})
        _anthropic_error(r, 401, "authentication_error")
        # past auth (x-api-key or Bearer), the model is still loading: 503, Anthropic's overloaded_error
        for headers in ({"x-api-key": "sk-good"}, {"authorization": "Bearer sk-good"}):
            r = await client.post("/v1/messages?beta=true", json=BODY, headers={**headers, "anthropic-version": "x"})
            _anthropic_error(r, 503, "overloaded_error")
        r = await client.post("/v1/chat/completions", json=BODY, headers={"x-api-key": "sk-bad"})
        assert r.status_code == 401 and "type" not in r.json()  # other routes keep OpenAI's envelope


async def test_shared_layers_errors_in_anthropics_envelope() -> None:
    async with _app(max_body_bytes=200, rate_limit_per_s=0.001, rate_limit_burst=2) as client:
        big = {**BODY, "system": "x" * 500}
        _anthropic_error(await client.post("/v1/messages/count_tokens", json=big), 413, "request_too_large")
        r = await client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert "JSON" in _anthropic_error(r, 400, "invalid_request_error")
        _anthropic_error(await client.post("/v1/messages", json=BODY), 429, "rate_limit_error")


async def test_a_stream_cut_by_the_timeout_ends_with_an_error_event() -> None:
    """The limits middleware's unnamed timeout event becomes Anthropic's `error` event on these routes."""
    from app.anthropic.errors import AnthropicErrors

    timeout = json.dumps({"error": {"message": "Timed out", "type": "timeout_error", "param": None, "code": None}})

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"event: ping\ndata: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": f"data: {timeout}\n\n".encode(), "more_body": False})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await AnthropicErrors(app)({"type": "http", "path": "/v1/messages"}, None, send)
    assert sent[1]["body"] == b"event: ping\ndata: {}\n\n"
    event, data = sent[2]["body"].decode().split("\n")[:2]
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {"type": "error", "error": {"type": "timeout_error",
                                                                                   "message": "Timed out"}}
