"""Structured output through the HTTP API on the bundled SmolLM2: OpenAI's response_format (with the real
openai SDK), vLLM's structured_outputs and guided_* on chat and completions, llama.cpp's grammar and
json_schema, streaming; and the 400s: an unknown type, two formats at once, schemas and grammars the grammar
library rejects, hostile ones (huge, deep, recursive, contradictory), none of which disturbs a request in flight.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support import PERSON

ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    body.setdefault("messages", ASK)
    body.setdefault("max_tokens", 80)
    return http.post("/v1/chat/completions", json=body)


def answer(resp: httpx.Response) -> tuple[str, str]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_openai_sdk_strict_json_schema(client: openai.OpenAI, model_id: str) -> None:
    reply = client.chat.completions.create(
        model=model_id, messages=ASK, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_openai_sdk_parse_with_a_pydantic_model(client: openai.OpenAI, model_id: str) -> None:
    class Person(BaseModel):
        name: str
        age: int

    reply = client.chat.completions.parse(model=model_id, messages=ASK, max_tokens=80, temperature=0,
                                          response_format=Person)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Person)


def test_json_object_sampled(client: openai.OpenAI, model_id: str) -> None:
    reply = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        max_tokens=150, temperature=0.7, seed=5, n=2, response_format={"type": "json_object"},
    )
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length"


def test_json_schema_streamed(client: openai.OpenAI, model_id: str) -> None:
    stream = client.chat.completions.create(
        model=model_id, messages=ASK, max_tokens=80, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    text, reasons = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["stop"]
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}}, lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t)),
        ({"structured_outputs": {"choice": ["cat", "dog"]}}, lambda t: t in ("cat", "dog")),
        ({"structured_outputs": {"grammar": 'root ::= "Name: " [A-Z] [a-z]+ "."'}},
         lambda t: re.fullmatch(r"Name: [A-Z][a-z]+\.", t)),
        ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_grammar": 'start: "x" /[0-9]{2}/'}, lambda t: re.fullmatch("x[0-9]{2}", t)),
        ({"grammar": 'root ::= ("a" | "b") ("a" | "b")'}, lambda t: re.fullmatch("[ab]{2}", t)),
        ({"json_schema": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"response_format": {"type": "json_object", "schema": PERSON}},
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_every_format_on_both_routes(http: httpx.Client, fields: dict, check: Any, route: str) -> None:
    if route == "chat":
        resp = chat(http, temperature=0, **fields)
    else:
        resp = http.post("/v1/completions", json={"prompt": "A person, as JSON:", "max_tokens": 80,
                                                   "temperature": 0, **fields})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    assert choice["finish_reason"] == "stop", text
    assert check(text) is not False, text


def test_text_format_is_free(http: httpx.Client) -> None:
    text, reason = answer(chat(http, temperature=0, max_tokens=20, response_format={"type": "text"}))
    assert reason in ("stop", "length") and text


def test_constrained_logprobs_are_finite(http: httpx.Client) -> None:
    resp = chat(http, temperature=0, logprobs=True, top_logprobs=5, guided_choice=["yes", "no"])
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert content and all(-9999.0 <= t["logprob"] <= 0.0 for t in content)
    assert all(-9999.0 <= a["logprob"] <= 0.0 for t in content for a in t["top_logprobs"])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": PERSON, "structured_outputs": {"regex": "a"}}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_json": {"type": "bogus"}}, "guided_json"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"grammar": "root ::= undefined"}, "grammar"),
        ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 3}}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}},
         "response_format"),
        ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "guided_json"),
        ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                                           for i in range(2000)}}}, "guided_json"),
        ({"guided_json": json.loads('{"items":' * 200 + "{}" + "}" * 200)}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
    ],
    ids=["unknown-type", "no-json-schema", "two-formats", "two-vllm", "two-keys", "structural-tag", "bad-regex",
         "bad-schema", "bad-gbnf", "undefined-rule", "contradictory", "recursive", "impossible-allof", "huge",
         "deep", "empty-choice"],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_rejected_formats_are_400s_naming_the_field(http: httpx.Client, fields: dict, param: str, route: str) -> None:
    if route == "chat":
        resp = chat(http, **fields)
    else:
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param), error


def test_rejected_schemas_do_not_disturb_a_request_in_flight(server: str, http: httpx.Client) -> None:
    """A streamed constrained request runs while hostile schemas are refused: it finishes, valid."""
    result: dict[str, Any] = {}

    def run() -> None:
        with httpx.Client(base_url=server, timeout=300) as own:
            result["resp"] = chat(own, temperature=0, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})

    worker = threading.Thread(target=run)
    worker.start()
    hostile = [{"guided_json": json.loads('{"items":' * 300 + "{}" + "}" * 300)},
               {"guided_regex": "(" * 50}, {"guided_json": {"type": "integer", "minimum": 9, "maximum": 1}},
               {"grammar": "root ::= root"}]
    for fields in hostile * 3:
        assert chat(http, **fields).status_code == 400
    worker.join(timeout=300)
    text, reason = answer(result["resp"])
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert http.get("/health/ready").status_code == 200
