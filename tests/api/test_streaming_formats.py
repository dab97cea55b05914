"""Stream framing against a real server: SSE event by event, NDJSON line by line, and the [DONE] rule.

The rule (app/streaming.py, docs/llama-stack.md): SSE unless the request asks for NDJSON (`Accept:
application/x-ndjson` or `?format=ndjson`); `data: [DONE]` ends OpenAI-route streams except for
llama-stack-client <= 0.6.0 (its `X-LlamaStack-Client-Version` header), never legacy Llama Stack streams;
`?done=` / `X-Peregrine-Done` override per request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"


def chat_body(model_id: str) -> dict[str, Any]:
    return {"model": model_id, "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 4, "temperature": 0, "stream": True}  # fmt: skip


def read_sse(http: httpx.Client, path: str, body: dict, **kwargs: Any) -> tuple[httpx.Response, list[str]]:
    """POST and split the body into events; every event must be exactly one `data: ` line."""
    response = http.post(path, json=body, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n")
    events = []
    for block in response.text.split("\n\n")[:-1]:
        lines = [line for line in block.split("\n") if not line.startswith(":")]  # comments are keep-alives
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        events.append(lines[0].removeprefix("data: "))
    return response, events


def read_ndjson(http: httpx.Client, path: str, body: dict, **kwargs: Any) -> list[dict]:
    """Stream the response and parse it line by line, as a line-reading client does."""
    with http.stream("POST", path, json=body, **kwargs) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [line for line in response.iter_lines() if line.strip()]
    assert lines and not any(line.startswith("data:") or line == "[DONE]" for line in lines)
    return [json.loads(line) for line in lines]


def test_openai_sse_ends_with_done(http: httpx.Client, model_id: str) -> None:
    _, events = read_sse(http, CHAT, chat_body(model_id))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("version", "done"), [("0.6.0", False), ("0.5.1", False), ("0.6.1", True), ("0.7.5", True)]
)
def test_done_follows_llama_stack_client_version(
    http: httpx.Client, model_id: str, version: str, done: bool
) -> None:
    _, events = read_sse(http, CHAT, chat_body(model_id), headers={"X-LlamaStack-Client-Version": version})
    assert (events[-1] == "[DONE]") is done
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events if e != "[DONE]")


def test_done_overridden_per_request(http: httpx.Client, model_id: str) -> None:
    _, events = read_sse(http, CHAT + "?done=false", chat_body(model_id))
    assert "[DONE]" not in events
    old = {"X-LlamaStack-Client-Version": "0.6.0", "X-Peregrine-Done": "true"}
    _, events = read_sse(http, CHAT, chat_body(model_id), headers=old)
    assert events[-1] == "[DONE]"


def test_openai_ndjson_on_accept(http: httpx.Client, model_id: str) -> None:
    chunks = read_ndjson(http, CHAT, chat_body(model_id), headers={"Accept": "application/x-ndjson"})
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    body = {"model": model_id, "prompt": "One, two,", "max_tokens": 3, "temperature": 0, "stream": True}
    chunks = read_ndjson(http, "/v1/completions?format=ndjson", body)
    assert {c["object"] for c in chunks} == {"text_completion"}


def test_legacy_sse_has_no_done_and_typed_deltas(http: httpx.Client, model_id: str) -> None:
    body = {"model_id": model_id, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "sampling_params": {"strategy": {"type": "greedy"}, "max_tokens": 3}}  # fmt: skip
    _, events = read_sse(http, "/v1/inference/chat-completion", body)
    assert "[DONE]" not in events
    parsed = [json.loads(e)["event"] for e in events]
    assert [e["event_type"] for e in parsed] == ["start"] + ["progress"] * (len(parsed) - 2) + ["complete"]
    assert all(e["delta"]["type"] == "text" for e in parsed)


def test_legacy_ndjson_line_by_line(http: httpx.Client, model_id: str) -> None:
    """The 0.0.x shapes, read the way the original boilerplate's client read them: one JSON per line."""
    body = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "sampling_params": {"strategy": "greedy", "max_tokens": 3}}  # fmt: skip
    events = [c["event"] for c in read_ndjson(http, "/inference/chat_completion?format=ndjson", body)]
    assert events[0] == {"event_type": "start", "delta": "", "stop_reason": None, "logprobs": None}
    assert all(e["event_type"] == "progress" and isinstance(e["delta"], str) for e in events[1:-1])
    assert events[-1]["event_type"] == "complete" and events[-1]["stop_reason"] == "out_of_tokens"
    body = {"model": model_id, "content": "One, two,", "stream": True, "sampling_params": {"max_tokens": 3}}
    chunks = read_ndjson(http, "/inference/completion", body, headers={"Accept": "application/x-ndjson"})
    assert all(set(c) >= {"delta", "stop_reason", "logprobs"} for c in chunks)
    assert chunks[-1]["stop_reason"] == "out_of_tokens"
