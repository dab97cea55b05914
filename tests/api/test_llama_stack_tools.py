"""Tools and structured output on the legacy Llama Stack chat route: raw requests in every era's shape, and the
real llama-stack-client 0.2.12 (its own venv, tests/interop/lsc_legacy_tools.py). Every call and every
structured answer validates."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.interop.harness import run_client
from tests.interop.venvs import CLIENT_LEGACY

pytestmark = pytest.mark.slow

WEATHER = {"tool_name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"city": {"param_type": "string"},
                          "unit": {"param_type": "string", "description": "celsius or fahrenheit"}}}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                  "required": ["city", "unit"]}
BOUNDED = {"tool_name": "get_weather", "description": "The current weather in a city.",  # sampled answers end
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30}},
        "required": ["name", "country"], "additionalProperties": False}
GREEDY = {"strategy": {"type": "greedy"}, "max_tokens": 120}
SAMPLED = {"strategy": {"type": "top_p", "temperature": 1.0, "top_p": 0.95}, "max_tokens": 120}


def chat(http: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[5:])["event"] for line in r.iter_lines() if line.startswith("data:")]


def check_call(call: dict[str, Any]) -> None:
    assert call["tool_name"] == "get_weather" and call["call_id"].startswith("call_")
    jsonschema.validate(call["arguments"], WEATHER_SCHEMA)
    assert json.loads(call["arguments_json"]) == call["arguments"]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("choice", [{"tool_choice": "required"}, {"tool_config": {"tool_choice": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_in_the_completion_message(http: httpx.Client, model_id: str, sampling: dict[str, Any],
                                              choice: dict[str, Any]) -> None:
    tool = WEATHER if sampling is GREEDY else BOUNDED  # Llama Stack requests carry no seed
    body = {"model_id": model_id, "messages": ASK, "tools": [tool], "sampling_params": sampling, **choice}
    message = chat(http, "/v1/inference/chat-completion", body)["completion_message"]
    assert message["stop_reason"] == "end_of_message" and len(message["tool_calls"]) >= 1
    for call in message["tool_calls"]:
        check_call(call)


def test_tool_call_stream_deltas_typed_and_bare(http: httpx.Client, model_id: str) -> None:
    body = {"model_id": model_id, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "sampling_params": GREEDY}
    typed = events(http, "/v1/inference/chat-completion", body)
    deltas = [e["delta"] for e in typed if e["delta"]["type"] == "tool_call"]
    assert [d["parse_status"] for d in deltas][0] == "started" and deltas[-1]["parse_status"] == "succeeded"
    check_call(deltas[-1]["tool_call"])
    fragments = "".join(d["tool_call"] for d in deltas if d["parse_status"] == "in_progress")
    assert json.loads(fragments) == deltas[-1]["tool_call"]["arguments"]
    assert typed[-1]["event_type"] == "complete" and typed[-1]["stop_reason"] == "end_of_message"
    bare = events(http, "/inference/chat_completion", body)
    done = [e["delta"] for e in bare if isinstance(e["delta"], dict) and e["delta"]["parse_status"] == "success"]
    assert len(done) == 1 and done[0]["content"]["arguments"] == deltas[-1]["tool_call"]["arguments"]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_response_format(http: httpx.Client, model_id: str, sampling: dict[str, Any]) -> None:
    body = {"model_id": model_id, "messages": [{"role": "user", "content": "Describe Paris."}],
            "sampling_params": sampling, "response_format": {"type": "json_schema", "json_schema": CITY}}
    message = chat(http, "/v1/inference/chat-completion", body)["completion_message"]
    assert message["stop_reason"] == "end_of_turn"
    jsonschema.validate(json.loads(message["content"]), CITY)
    body["response_format"] = {"type": "grammar", "bnf": {"grammar": 'root ::= "yes" | "no"'}}
    assert chat(http, "/alpha/inference/chat-completion", body)["completion_message"]["content"] in ("yes", "no")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": "get_time"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_prompt_format": "xml"}, "tool_prompt_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"$ref": "#/nope"}}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_schema",
                                                                           "json_schema": CITY}}, "tool_choice"),
])
def test_what_cannot_be_honoured_is_a_400(http: httpx.Client, model_id: str, fields: dict[str, Any],
                                          param: str) -> None:
    body = {"model_id": model_id, "messages": ASK, "sampling_params": GREEDY, **fields}
    assert chat(http, "/v1/inference/chat-completion", body, 400)["error"]["param"] == param


@pytest.mark.interop
@pytest.mark.timeout(3600)  # a first run builds the client's venv
def test_legacy_client_tools_and_json_schema(server: str, model_id: str) -> None:
    seen = run_client(CLIENT_LEGACY, "lsc_legacy_tools.py", server, model_id)
    required = seen["required"]
    assert required["stop_reason"] == "end_of_message" and required["calls"]
    assert all(c["tool_name"] == "get_weather" and isinstance(c["arguments"]["city"], str)
               for c in required["calls"])
    stream = seen["stream"]
    assert stream["delta_types"] == ["text", "tool_call"] or stream["delta_types"] == ["tool_call"]
    assert stream["statuses"][0] == "started" and stream["statuses"][-1] == "succeeded"
    assert [c["tool_name"] for c in stream["calls"]] == ["get_weather"]
    assert stream["stop_reason"] == "end_of_message"
    assert seen["after_tool"]["content"] or seen["after_tool"]["calls"]
    jsonschema.validate(json.loads(seen["structured"]), {
        "type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"], "additionalProperties": False})
