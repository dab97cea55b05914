"""OpenAI's Responses API through a real server with the bundled SmolLM2 and the real `openai` SDK:
`responses.create`, `responses.stream` (the event sequence, in order), `responses.parse` with a pydantic
model, a function-tool round trip, `previous_response_id` over three turns, `retrieve`, `input_items`,
`delete`, and OpenAI's 4xx envelope for bad input. The small model is checked for the protocol (a finished turn,
events in order, tool calls parsed against the schema, usage counted), not for the quality of its answers."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False},
}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}


class Person(BaseModel):
    name: str
    age: int


def _check_usage(response) -> None:
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens


def test_create_returns_a_finished_message(client: openai.OpenAI, model_id: str) -> None:
    response = client.responses.create(model=model_id, input="Say hello.", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model_id
    assert response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and response.output[0].content[0].type == "output_text"
    assert response.instructions == "Be brief."
    _check_usage(response)
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 8


def test_stream_sends_the_event_sequence(client: openai.OpenAI, model_id: str) -> None:
    with client.responses.stream(model=model_id, input="Count to three.", max_output_tokens=12) as stream:
        events = list(stream)
    final = events[-1].response  # the SDK's get_final_response() accepts only response.completed
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if final.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text
    _check_usage(final)


def test_parse_fills_a_pydantic_model(client: openai.OpenAI, model_id: str) -> None:
    response = client.responses.parse(model=model_id, input="Invent a person.", text_format=Person,
                                      max_output_tokens=60, temperature=0)
    assert isinstance(response.output_parsed, Person)
    assert response.text.format.type == "json_schema"


def test_function_tool_round_trip_and_three_turns(client: openai.OpenAI, model_id: str) -> None:
    first = client.responses.create(model=model_id, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice=FORCE_WEATHER, max_output_tokens=40, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=model_id, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=16, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}],
    )
    assert second.previous_response_id == first.id and second.output_text
    third = client.responses.create(model=model_id, previous_response_id=second.id, input="Thanks!",
                                    tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0)
    assert third.output_text and third.status in ("completed", "incomplete")
    # the third turn's prompt holds the first two (same tools): longer than the second's, its prefix cached
    assert third.usage.input_tokens > second.usage.input_tokens > 0
    assert third.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(third.id).output_text == third.output_text
    items = client.responses.input_items.list(second.id).data
    assert [i.type for i in items] == ["function_call_output"]
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError) as caught:  # a deleted response cannot be continued
        client.responses.create(model=model_id, previous_response_id=third.id, input="Again?", max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id"


def test_streamed_function_call_events(client: openai.OpenAI, model_id: str) -> None:
    with client.responses.stream(model=model_id, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice=FORCE_WEATHER, max_output_tokens=80, temperature=0) as stream:
        events = list(stream)
    types, final = [e.type for e in events], events[-1].response
    assert "response.function_call_arguments.delta" in types
    done = types.index("response.function_call_arguments.done")
    assert types[done + 1] == "response.output_item.done" and types[-1] == "response.completed"
    call = next(item for item in final.output if item.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_store_false_is_not_kept(client: openai.OpenAI, model_id: str) -> None:
    response = client.responses.create(model=model_id, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


BAD = [
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "mystery_item"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"input": 42}, "input"),
    ({}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_in_openais_envelope(http: httpx.Client, body: dict, param: str) -> None:
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_unknown_ids_and_non_json_bodies(http: httpx.Client, model_id: str) -> None:
    unknown = http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_unknown"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    for method in ("GET", "DELETE"):
        assert http.request(method, "/v1/responses/resp_unknown").status_code == 404
    assert http.get("/v1/responses/resp_unknown/input_items").status_code == 404
    garbage = http.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert garbage.status_code == 400 and garbage.json()["error"]["type"] == "invalid_request_error"
    other_model = http.post("/v1/responses", json={"model": "no-such-model", "input": "hi"})
    assert other_model.status_code == 404 and other_model.json()["error"]["param"] == "model"
