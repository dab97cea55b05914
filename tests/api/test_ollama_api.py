"""Ollama's API (/api/*) against the live test server, with the real `ollama` Python client where it has a call for
the route: chat streamed and not, generate (templated and raw), embed, list, ps, show, pull of a local GGUF,
structured `format`, tool calls, and errors raised as `ollama.ResponseError` with their status. The bundled model is
small: these check the protocol (a finished turn, lines in order, counts), not the answers."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from pydantic import BaseModel

from models.hub import bundled_path

OPTIONS = {"num_predict": 8, "temperature": 0}
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(server: str) -> ollama.Client:
    return ollama.Client(host=server, timeout=300)


@pytest.fixture(scope="module")
def model(client: ollama.Client, model_id: str) -> str:
    return model_id


def check_done(answer: ollama.ChatResponse | ollama.GenerateResponse, max_eval: int) -> None:
    assert answer.done is True and answer.done_reason in ("stop", "length")
    assert answer.prompt_eval_count and answer.prompt_eval_count > 0
    assert answer.eval_count and 0 < answer.eval_count <= max_eval
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration > 0
    assert answer.load_duration is not None and answer.load_duration >= 0


def test_liveness_for_clients_and_the_chat_page_for_browsers(server: str, client: ollama.Client) -> None:
    plain = httpx.get(f"{server}/", timeout=30)
    assert plain.status_code == 200 and plain.text == "Ollama is running"
    assert httpx.head(f"{server}/", timeout=30).status_code == 200
    page = httpx.get(f"{server}/", headers={"Accept": "text/html,application/xhtml+xml"}, timeout=30)
    assert page.headers["content-type"].startswith("text/html") and "<html" in page.text
    assert httpx.get(f"{server}/api/version", timeout=30).json()["version"]


def test_list_ps_and_show(client: ollama.Client, model: str) -> None:
    listed = {m.model: m for m in client.list().models}
    entry = listed[model]
    assert entry.size and entry.size > 1_000_000 and entry.digest and entry.modified_at is not None
    assert entry.details.format == "gguf" and entry.details.family == "llama"
    assert entry.details.quantization_level == "Q4_1" and entry.details.parameter_size.endswith("M")
    running = {m.model: m for m in client.ps().models}
    assert running[model].size and running[model].expires_at is not None and running[model].context_length == 2048
    shown = client.show(model)
    assert "<|im_start|>" in shown.template and shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 2048 and "num_ctx" in shown.parameters


def test_chat_not_streamed_and_streamed_agree(client: ollama.Client, model: str) -> None:
    whole = client.chat(model=model, messages=HI, options=OPTIONS, stream=False)
    assert whole.message.role == "assistant" and whole.message.content
    check_done(whole, 8)
    parts = list(client.chat(model=model, messages=HI, options=OPTIONS, stream=True))
    assert all(p.done is False for p in parts[:-1]) and parts[-1].done is True
    check_done(parts[-1], 8)
    assert "".join(p.message.content or "" for p in parts) == whole.message.content  # greedy: the same answer
    assert parts[-1].eval_count == whole.eval_count


def test_chat_stream_is_ndjson_by_default(server: str, model: str) -> None:
    body = {"model": model, "messages": HI, "options": {"num_predict": 3}}  # no "stream": Ollama streams
    with httpx.stream("POST", f"{server}/api/chat", json=body, timeout=300) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 3 and lines[-1]["done_reason"] == "length"
    assert all(isinstance(line[k], int) for line in lines[-1:] for k in ("total_duration", "eval_duration"))


def test_generate_templated_and_raw(client: ollama.Client, model: str) -> None:
    answer = client.generate(model=model, prompt="Say hello.", system="Be brief.", options=OPTIONS)
    assert answer.response and answer.context is None
    check_done(answer, 8)
    raw = list(client.generate(model=model, prompt="Once upon a time", raw=True, options=OPTIONS, stream=True))
    assert raw[-1].done and raw[-1].prompt_eval_count < 10  # no chat template around it
    assert "".join(p.response for p in raw)


class City(BaseModel):
    name: str
    population: int


def test_structured_format(client: ollama.Client, model: str) -> None:
    options = {"num_predict": 32, "temperature": 0}
    answer = client.chat(model=model, messages=[{"role": "user", "content": "A city, as JSON."}],
                         format=City.model_json_schema(), options=options)  # fmt: skip
    if answer.done_reason == "stop":  # a cut answer cannot parse; the constraint still held token by token
        City.model_validate_json(answer.message.content)
    else:
        assert answer.message.content.startswith("{")
    any_json = client.generate(model=model, prompt="Some JSON please.", format="json", options=options)
    assert any_json.response.lstrip().startswith("{")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_call_and_its_result(server: str, client: ollama.Client, model: str) -> None:
    forced = {"model": model, "stream": False, "messages": [{"role": "user", "content": "Weather in Paris?"}],
              "tools": [WEATHER], "tool_choice": "required", "options": {"num_predict": 40, "temperature": 0}}
    answer = httpx.post(f"{server}/api/chat", json=forced, timeout=300).json()
    call = answer["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and isinstance(call["arguments"], dict) and "city" in call["arguments"]
    messages = [*forced["messages"], answer["message"], {"role": "tool", "tool_name": "get_weather",
                                                         "content": '{"celsius": 21}'}]  # fmt: skip
    follow = client.chat(model=model, messages=messages, tools=[WEATHER], options=OPTIONS)
    assert follow.done and follow.prompt_eval_count > answer["prompt_eval_count"]


def test_embed_and_the_older_embeddings(server: str, client: ollama.Client) -> None:
    name = next(m.model for m in client.list().models if m.details.family == "bert")
    out = client.embed(model=name, input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 384 and out.prompt_eval_count > 0
    old = client.embeddings(model=name, prompt="a cat")
    assert old.embedding == pytest.approx(out.embeddings[0], abs=1e-5)


def test_pull_of_a_local_gguf(client: ollama.Client) -> None:
    statuses = [p.status for p in client.pull(str(bundled_path("smollm2")), stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert client.pull(str(bundled_path("smollm2"))).status == "success"
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("/nonexistent/model.gguf")
    assert missing.value.status_code == 404 and "no such file" in missing.value.error


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c, m: c.chat(model="no-such-model", messages=HI), 404, "does not exist"),
        (lambda c, m: c.chat(model=m, messages=[{"role": "user", "content": "x", "images": [b"\x89PNG"]}]), 400,
         "images"),
        (lambda c, m: c.generate(model=m, prompt="x", options={"temperature": 9}), 400, "options.temperature"),
        (lambda c, m: c.generate(model=m, prompt="x", keep_alive="soon"), 400, "keep_alive"),
        (lambda c, m: c.show("no-such-model"), 404, "does not exist"),
        (lambda c, m: c.delete(m), 400, "served"),
        (lambda c, m: c.delete("org/never-downloaded"), 404, "not found"),
        (lambda c, m: c.embed(model=m, input="x"), 400, "text generation model"),
    ],
)
def test_errors_are_response_errors_with_their_status(client: ollama.Client, model: str, call, status, words) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        call(client, model)
    assert caught.value.status_code == status and words in caught.value.error


NOT_OBJECTS = [b"not json", b"[]", b'{"model": 3}']
BAD_GENERATION = [*NOT_OBJECTS, b'{"model": "m", "options": {"num_predict": "many"}}', b'{"model": "m", "format": 7}']
BAD = {"/api/chat": [*BAD_GENERATION, b'{"model": "m", "messages": [{"role": "bot"}]}', b'{"model": "m", "messages": "hi"}'],
       "/api/generate": [*BAD_GENERATION, b'{"model": "m", "prompt": ["a"]}'], "/api/embed": [*NOT_OBJECTS,
       b'{"model": "m"}'], "/api/show": NOT_OBJECTS, "/api/pull": NOT_OBJECTS}  # fmt: skip


@pytest.mark.parametrize("route", sorted(BAD))
def test_bad_bodies_get_ollama_400s(server: str, route: str) -> None:
    for body in BAD[route]:
        r = httpx.post(f"{server}{route}", content=body, timeout=60)
        assert r.status_code == 400, (route, body, r.text)
        assert isinstance(r.json()["error"], str)
    r = httpx.request("DELETE", f"{server}/api/delete", content=b"not json", timeout=60)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_load_only_requests_and_unknown_routes(server: str, model: str) -> None:
    loaded = httpx.post(f"{server}/api/generate", json={"model": model, "stream": False}, timeout=60).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load" and loaded["response"] == ""
    gone = httpx.post(f"{server}/api/create", json={"model": "x"}, timeout=60)
    assert gone.status_code == 404 and isinstance(gone.json()["error"], str)
