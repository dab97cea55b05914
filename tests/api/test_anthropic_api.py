"""Anthropic's Messages API through a real server with the bundled SmolLM2 and the real `anthropic` SDK:
`messages.create`, `messages.stream` (events in order, the final message assembled by the SDK), a tool round trip
with a forced `tool_choice`, `count_tokens`, and errors raising the SDK's matching exception classes. The model is
small: these check the protocol (a finished turn, events in order, calls parsed, usage counted), not the answers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HI = [{"role": "user", "content": "Name three colours."}]
# anthropic 2.x no longer takes temperature / top_p / top_k as arguments; the API (and this server) still does
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server: str) -> Iterator[anthropic.Anthropic]:
    """The real SDK pointed at the server (no retries, so an error shows as it is)."""
    with anthropic.Anthropic(base_url=server, api_key="any", max_retries=0, timeout=300) as client:
        yield client


def test_create_returns_a_finished_message(claude: anthropic.Anthropic, model_id: str) -> None:
    message = claude.messages.create(model=model_id, max_tokens=24, messages=HI, extra_body=GREEDY,
                                     system=[{"type": "text", "text": "You are brief."}], metadata={"user_id": "u"})
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens")
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 10
    assert 0 < message.usage.output_tokens <= 24


def test_stop_sequence_ends_the_turn(claude: anthropic.Anthropic, model_id: str) -> None:
    """A word of the greedy answer, as a stop sequence, ends the same answer there."""
    first = claude.messages.create(model=model_id, max_tokens=24, messages=HI, extra_body=GREEDY)
    text = first.content[0].text
    words = [w for w in text.split() if len(w) > 3]
    assert words, text
    stop = words[0]
    message = claude.messages.create(model=model_id, max_tokens=24, messages=HI, extra_body=GREEDY,
                                     stop_sequences=["never-seen-xyz", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text.startswith(message.content[0].text if message.content else "") and stop not in message.content[0].text


def test_a_last_assistant_turn_is_continued(claude: anthropic.Anthropic, model_id: str) -> None:
    """Anthropic's prefill: the answer continues the last assistant turn (greedy: the same tokens as the answer
    given without it), and count_tokens counts that prompt."""
    first = claude.messages.create(model=model_id, max_tokens=16, messages=HI, extra_body=GREEDY).content[0].text
    prefill = " ".join(first.split()[:2])
    assert prefill, first
    history = [*HI, {"role": "assistant", "content": prefill}]
    message = claude.messages.create(model=model_id, max_tokens=8, messages=history, extra_body=GREEDY)
    rest = message.content[0].text
    assert first.startswith(prefill) and first[len(prefill):].startswith(rest[:12]) and rest.strip(), (first, rest)
    counted = claude.messages.count_tokens(model=model_id, messages=history).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_stream_events_in_order_and_the_sdk_assembles_the_message(claude: anthropic.Anthropic, model_id: str) -> None:
    with claude.messages.stream(model=model_id, max_tokens=16, messages=HI, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and types[-2] == "message_delta"
    raw = [t for t in types if t not in ("text",)]  # the SDK adds `text` helper events beside the deltas
    assert raw[1] == "content_block_start" and raw[-3] == "content_block_stop"
    assert set(raw[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert final.content[0].type == "text" and final.content[0].text == text and text
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 16
    same = claude.messages.create(model=model_id, max_tokens=16, messages=HI, extra_body=GREEDY)
    assert same.content[0].text == text and same.stop_reason == final.stop_reason


def _check_call(block: Any) -> dict[str, Any]:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER["input_schema"])
    return block.input


def test_tool_round_trip(claude: anthropic.Anthropic, model_id: str) -> None:
    """A forced call (streamed: input_json_delta assembled by the SDK), its result sent back, a finished turn."""
    choice = {"type": "tool", "name": "get_weather"}
    with claude.messages.stream(model=model_id, max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice=choice, extra_body=GREEDY) as stream:
        events = list(stream)
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    call = next(b for b in first.content if b.type == "tool_use")
    _check_call(call)
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}]
    answer = claude.messages.create(model=model_id, max_tokens=24, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]


def test_schema_keywords_the_grammar_lacks_do_not_fail_the_request(claude: anthropic.Anthropic, model_id: str) -> None:
    """Claude Code's tool schemas use `propertyNames`, which the grammar library does not implement: the call is
    still constrained by the rest of the schema, not refused."""
    tool = {"name": "tag", "description": "Tag a city.", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "labels": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}},
        "required": ["city"]}}  # fmt: skip
    message = claude.messages.create(model=model_id, max_tokens=120, messages=ASK, tools=[tool],
                                     tool_choice={"type": "tool", "name": "tag"}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "tag" and isinstance(call.input.get("city"), str)


def test_tool_choice_any_returns_a_call(claude: anthropic.Anthropic, model_id: str) -> None:
    message = claude.messages.create(model=model_id, max_tokens=60, messages=ASK, tools=[WEATHER],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    assert [_check_call(b) for b in message.content if b.type == "tool_use"]


def test_count_tokens_counts_what_the_model_is_fed(claude: anthropic.Anthropic, model_id: str) -> None:
    for extra in ({}, {"tools": [WEATHER], "system": "You are brief."}):
        counted = claude.messages.count_tokens(model=model_id, messages=ASK, **extra)
        message = claude.messages.create(model=model_id, max_tokens=1, messages=ASK, **extra)
        assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert claude.messages.count_tokens(model=model_id, messages=ASK, tools=[WEATHER]).input_tokens > \
        claude.messages.count_tokens(model=model_id, messages=ASK).input_tokens


def test_errors_raise_the_sdks_exception_classes(claude: anthropic.Anthropic, model_id: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    assert "no-such-model" in info.value.message and info.value.body["error"]["type"] == "not_found_error"
    bad: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                               "media_type": "image/png", "data": "AA=="}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none"}]}]},
        {"messages": HI, "extra_body": {"temperature": 1.5}},
        {"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    ]  # fmt: skip
    for fields in bad:
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model=model_id, max_tokens=4, **fields)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="does not fit"):
        claude.messages.create(model=model_id, max_tokens=4, messages=[{"role": "user", "content": "word " * 9000}])


@pytest.mark.parametrize(
    ("body", "paths"),
    [(b"not json", 2), (b"[1, 2]", 2),
     (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', 1),
     (b'{"model": "m", "max_tokens": "many", "messages": [{"role": "user", "content": "hi"}]}', 1),
     (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]}', 2),
     (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}', 2)],
    ids=["not-json", "not-object", "no-max-tokens", "wrong-type", "unknown-block", "unknown-role"],
)
def test_bad_bodies_are_400_in_anthropics_envelope(http: httpx.Client, body: bytes, paths: int) -> None:
    """On both routes (count_tokens takes no max_tokens: those bodies are checked on /v1/messages only)."""
    for path in ("/v1/messages?beta=true", "/v1/messages/count_tokens")[:paths]:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
