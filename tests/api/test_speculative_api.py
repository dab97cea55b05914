"""Speculative decoding through the HTTP API: a real server started with `--speculative ngram` answers the openai
SDK's requests exactly as the session's server without speculation does (greedy, the bundled SmolLM2, the same
dense float32 weights), for constrained output too: a strict JSON schema extracting from the prompt, a named tool
call whose arguments come from the prompt, the same schema streamed, and tool_choice auto (a grammar waiting for its
trigger). Its /metrics show that the constrained requests proposed tokens and that proposals were kept. The server
proposes every step (`--no-speculative-adaptive`): on these dense float32 weights a verified row costs enough that
the adaptive rule may rightly propose nothing on a busy machine (CI saw a copy with no proposal kept), and what this
file checks is the answers; the rule has its own tests."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import SERVER_ARGS
from tests.support import PERSON, main_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXTRACT = [{"role": "user", "content": "Extract the person as JSON with the keys name and age: 'Ada Lovelace, aged "
                                      "36, wrote the first program.' Answer with the JSON only."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "I am flying to Reykjavik tomorrow. What is the weather in Reykjavik?"}]
COPY = [{"role": "user", "content": "Repeat this sentence exactly: The lighthouse keeper climbed the ninety steps "
                                   "every night and wound the clockwork that turned the lens."}]


@pytest.fixture(scope="module")
def spec_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("PEREGRINE_TEST_SERVER_URL"):
        pytest.skip("compares with the session's own server, started with known arguments")
    workdir: Path = tmp_path_factory.mktemp("spec-server")
    with main_server(workdir, *SERVER_ARGS, "--speculative", "ngram", "--no-speculative-adaptive") as (url, _log):
        yield url


def spec_counters(base_url: str) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=60).text

    def value(name: str) -> float:
        found = re.search(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        assert found, f"{name} missing from /metrics"
        return float(found.group(1))

    return value("peregrine_spec_proposed_tokens"), value("peregrine_spec_accepted_tokens")


def requests(client: openai.OpenAI, model: str) -> dict[str, Any]:
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out: dict[str, Any] = {}
    r = client.chat.completions.create(model=model, messages=EXTRACT, max_tokens=60, temperature=0,
                                       response_format=schema)
    out["schema"] = (r.choices[0].message.content, r.choices[0].finish_reason)
    r = client.chat.completions.create(model=model, messages=ASK_WEATHER, max_tokens=60, temperature=0,
                                       tools=[WEATHER], tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0].function
    out["tool"] = (call.name, call.arguments)
    stream = client.chat.completions.create(model=model, messages=EXTRACT, max_tokens=60, temperature=0,
                                            response_format=schema, stream=True)
    out["streamed"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return out


def test_constrained_and_free_answers_are_those_without_speculation(server: str, spec_url: str) -> None:
    plain = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=600)
    spec = openai.OpenAI(base_url=f"{spec_url}/v1", api_key="none", timeout=600)
    model = plain.models.list().data[0].id
    assert spec.models.list().data[0].id == model
    want = requests(plain, model)
    before = spec_counters(spec_url)
    got = requests(spec, model)
    after = spec_counters(spec_url)
    assert got == want
    jsonschema.validate(json.loads(got["schema"][0]), PERSON)
    assert got["schema"][1] == "stop" and got["streamed"] == got["schema"][0]
    assert got["tool"][0] == "get_weather" and isinstance(json.loads(got["tool"][1])["city"], str)
    assert after[0] > before[0], "the constrained requests proposed nothing"
    free = {c: c.chat.completions.create(model=model, messages=COPY, max_tokens=40, temperature=0)
            .choices[0].message.content for c in (plain, spec)}
    assert free[spec] == free[plain]
    assert spec_counters(spec_url)[1] > 0, "no proposal was kept"


def test_tool_choice_auto_speculates_before_its_trigger(server: str, spec_url: str) -> None:
    """With tools offered and tool_choice auto, the tool-call grammar waits for its trigger (a lazy constraint):
    the free text before it speculates too, and the answers (text or call) are those without speculation."""
    plain = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=600)
    spec = openai.OpenAI(base_url=f"{spec_url}/v1", api_key="none", timeout=600)
    model = plain.models.list().data[0].id

    def answers(client: openai.OpenAI) -> list[Any]:
        out = []
        for messages in (COPY, ASK_WEATHER):
            message = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                                     tools=[WEATHER], tool_choice="auto").choices[0].message
            out.append((message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []]))
        return out

    want = answers(plain)
    before = spec_counters(spec_url)
    assert answers(spec) == want
    assert want[0][0] and "lighthouse" in want[0][0]  # the copy is free text
    assert spec_counters(spec_url)[1] > before[1], "nothing was kept before the trigger"
