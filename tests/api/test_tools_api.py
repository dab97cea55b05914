"""Tools on /v1/chat/completions through a real server with the bundled SmolLM2 and the openai SDK:
`tool_choice` required / named / auto / none, `parallel_tool_calls`, streamed tool-call deltas assembled by the
SDK's stream helper, a tool round trip, and 400s for what cannot be honoured. Every call validates."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"utc_offset": {"type": "integer", "minimum": -12,
                                                                       "maximum": 14}}, "required": ["utc_offset"]},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]
SAMPLED = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]


def check_calls(calls: Any, names: set[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Every call names a tool (of `names`) and its arguments validate against that tool's schema."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return out


@pytest.mark.parametrize("sampling", SAMPLED, ids=["greedy", "sampled"])
def test_required_returns_valid_calls(client: openai.OpenAI, model_id: str, sampling: dict[str, Any]) -> None:
    r = client.chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, **sampling)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("sampling", SAMPLED, ids=["greedy", "sampled"])
def test_named_tool_while_streaming(client: openai.OpenAI, model_id: str, sampling: dict[str, Any]) -> None:
    """The SDK's stream helper assembles the deltas; the raw deltas are OpenAI's shape (name first)."""
    choice = {"type": "function", "function": {"name": "get_time"}}
    with client.chat.completions.stream(model=model_id, messages=ASK, tools=TOOLS, tool_choice=choice,
                                        max_tokens=200, **sampling) as stream:
        deltas = [tc for event in stream if event.type == "chunk" for c in event.chunk.choices
                  for tc in (c.delta.tool_calls or [])]
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    [(name, _)] = check_calls(final.choices[0].message.tool_calls, {"get_time"})
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_time" and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == final.choices[0].message.tool_calls[0].function.arguments


def test_parallel_false_gives_one_call(client: openai.OpenAI, model_id: str) -> None:
    r = client.chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=200)
    assert len(check_calls(r.choices[0].message.tool_calls)) == 1


def test_auto_and_none(client: openai.OpenAI, model_id: str) -> None:
    """auto: text, or calls that validate; none: text only, never parsed into calls."""
    r = client.chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    r = client.chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=30)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


def test_tool_round_trip(client: openai.OpenAI, model_id: str) -> None:
    """A call, its result sent back as a `tool` message, and the model's answer to the user."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model_id, messages=ask, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=100)
    call = r.choices[0].message.tool_calls[0]
    history = [*ask, r.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = client.chat.completions.create(model=model_id, messages=history, tools=[WEATHER], temperature=0,
                                           max_tokens=60)
    assert final.choices[0].message.content or final.choices[0].message.tool_calls
    streamed = client.chat.completions.create(model=model_id, messages=history, tools=[WEATHER], temperature=0,
                                              max_tokens=60, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == (final.choices[0].message.content or "")


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_what_cannot_be_honoured_is_a_400(http: httpx.Client, model_id: str, body: dict[str, Any],
                                          param: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": model_id, "messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and (error["param"] or "").startswith(param), error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_call_once_started_is_completed_valid(client: openai.OpenAI, http: httpx.Client, model_id: str,
                                                   stream: bool) -> None:
    """The 135M model does not call tools by itself; a logit bias on the tokens of `<tool_call>` makes it start
    one, and from the trigger on the lazy grammar completes it: a valid call, then the answer ends."""
    ids = http.post("/tokenize", json={"model": model_id, "prompt": "<tool_call>", "add_special_tokens": False})
    bias = {str(i): 30 for i in ids.json()["tokens"]}
    city = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
        "required": ["city"]}}}
    kwargs = {"model": model_id, "messages": ASK, "tools": [city], "temperature": 0, "max_tokens": 80,
              "logit_bias": bias}
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            response = s.get_final_completion()
    else:
        response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "London")


def test_each_of_n_choices_gets_its_calls(client: openai.OpenAI, model_id: str) -> None:
    r = client.chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, tool_choice="required", n=2,
                                       temperature=1.0, seed=3, max_tokens=200)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
