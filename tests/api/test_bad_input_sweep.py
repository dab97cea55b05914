"""Every POST route of every API family against the same hostile bodies: a 4xx in the family's own error envelope or
an answer, never a 5xx or a hang, and the server answers normally afterwards. (Each route's own tests check its
messages and fields; this sweep guards the routes nobody thought to send a given mistake to.)"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize",
          "/v1/inference/chat-completion", "/v1/inference/completion", "/v1/inference/batch-chat-completion",
          "/v1/inference/batch-completion", "/v1/inference/embeddings", "/v1/messages", "/v1/messages/count_tokens",
          "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show", "/api/pull"]
HI = [{"role": "user", "content": "hi"}]
RAW = [b"", b"not json", b"[]", b"null", b"1", b'{"model": 5}', b"{}", b'{"messages": [\xff]}', b'{"prompt": "x",}']


def bodies(model: str) -> list[dict[str, Any]]:
    m = model
    return [
        {"model": m}, {"model": m, "messages": "x"}, {"model": m, "messages": [1]}, {"model": m, "messages": [{}]},
        {"model": m, "messages": [{"role": "user"}]}, {"model": m, "messages": [{"role": "bogus", "content": "x"}]},
        {"model": m, "messages": HI, "max_tokens": -1}, {"model": m, "messages": HI, "max_tokens": "a"},
        {"model": m, "messages": HI, "temperature": "hot"}, {"model": m, "messages": HI, "temperature": -1},
        {"model": m, "messages": HI, "n": 1000}, {"model": m, "messages": HI, "stop": 5},
        {"model": m, "messages": HI, "logprobs": True, "top_logprobs": 100}, {"model": m, "messages": HI, "tools": "x"},
        {"model": m, "messages": HI, "tools": [{"type": "function"}]},
        {"model": m, "messages": HI, "response_format": {"type": "json_schema"}},
        {"model": m, "messages": HI, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
        {"model": m, "messages": HI, "logit_bias": {"abc": 1}}, {"model": m, "messages": HI, "seed": "x"},
        {"model": m, "messages": HI, "stream": "yes"}, {"model": m, "messages": HI, "stream": True,
                                                         "stream_options": "x"},
        {"model": m, "prompt": 5}, {"model": m, "prompt": [[-1]]}, {"model": m, "prompt": [10**9]},
        {"model": m, "prompt": ""}, {"model": m, "prompt": "hi", "echo": True, "logprobs": 3},
        {"model": m, "input": 5}, {"model": m, "input": [[]]}, {"model": m, "input": ""},
        {"model": m, "input": [{"type": "bogus"}]}, {"model": m, "input": "hi", "previous_response_id": "nope"},
        {"model": m, "tokens": ["a"]}, {"model": m, "tokens": [10**9]}, {"model": m, "system": 5, "messages": HI},
        {"model": m, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"model": m, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        {"model": m, "messages": HI, "options": "x"}, {"model": m, "messages": HI, "options": {"num_predict": "x"}},
        {"model": m, "prompt": "hi", "options": {"num_ctx": -5, "num_predict": 2}},
        {"model": m, "messages": HI, "format": {"type": "bogus"}, "stream": False},
        {"model": m, "messages": HI, "format": "xml", "stream": False},
        {"model_id": m, "messages": HI, "sampling_params": "x"},
        {"model_id": m, "messages": HI, "sampling_params": {"strategy": {"type": "bogus"}}},
        {"model_id": m, "content": 5}, {"model_id": m, "messages_batch": 5}, {"model_id": m, "content_batch": [5]},
        {"model_id": m, "contents": [5]}, {"model": m, "name": 5}, {"model": "no-such-model", "messages": HI},
    ]


def capped(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body with a 4-token generation limit in the route's own field where it names none (a valid request
    among the hostile ones then answers in a moment)."""
    body = dict(body)
    if route.startswith("/api/"):
        body.setdefault("options", {"num_predict": 4})
    elif route == "/v1/responses":
        body.setdefault("max_output_tokens", 4)
    else:
        body.setdefault("max_tokens", 4)
    return body


def check_envelope(route: str, response: httpx.Response) -> None:
    what = f"{route} answered {response.status_code}: {response.text[:300]}"
    assert response.status_code < 500, what
    if response.status_code < 400:
        return
    error = response.json()
    assert isinstance(error, dict), what
    if route.startswith("/v1/messages"):  # Anthropic's envelope
        assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"], what
    elif route.startswith("/api/"):  # Ollama's: one string
        assert isinstance(error["error"], str) and error["error"], what
    else:  # OpenAI's (Llama Stack's routes and /tokenize answer in it too)
        assert error["error"]["message"] and error["error"]["type"], what


def test_every_route_refuses_hostile_bodies_in_its_own_envelope(server: str, model_id: str) -> None:
    with httpx.Client(base_url=server, timeout=120) as http:
        for route in ROUTES:
            for raw in RAW:
                check_envelope(route, http.post(route, content=raw, headers={"content-type": "application/json"}))
            for body in bodies(model_id):
                check_envelope(route, http.post(route, json=capped(route, body)))
        answer = http.post("/v1/chat/completions", json={"model": model_id, "messages": HI, "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] is not None
        assert http.get("/ready").status_code == 200
