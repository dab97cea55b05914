"""use.py's Llama Stack checks (its own routes and the legacy inference routes, through httpx), and the helpers
every check shares."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import httpx

QUESTION = "What is the capital of France?"


class HttpCtx(Protocol):
    """What these checks read of use.py's `Ctx`."""

    http: httpx.Client
    model: str
    max_tokens: int


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def check_llama_stack_health(ctx: HttpCtx) -> str:
    return str(http_json(ctx, "GET", "/v1/health"))


def check_llama_stack_version(ctx: HttpCtx) -> str:
    return str(http_json(ctx, "GET", "/v1/version"))


def check_llama_stack_providers(ctx: HttpCtx) -> str:
    data = http_json(ctx, "GET", "/v1/providers")["data"]
    expect(bool(data), "no provider listed")
    return ", ".join(f"{p['provider_id']} ({p['provider_type']}, {p['health']['status']})" for p in data)


def legacy_chat_body(ctx: HttpCtx, stream: bool) -> dict:
    return {"model_id": ctx.model, "messages": [{"role": "user", "content": QUESTION}], "stream": stream,
            "sampling_params": {"max_tokens": ctx.max_tokens, "strategy": {"type": "greedy"}}}


def legacy_completion_body(ctx: HttpCtx, stream: bool) -> dict:
    return {"model_id": ctx.model, "content": "The capital of France is", "stream": stream,
            "sampling_params": {"max_tokens": ctx.max_tokens, "strategy": {"type": "greedy"}}}


def check_legacy_chat(ctx: HttpCtx) -> str:
    body = http_json(ctx, "POST", "/inference/chat_completion", legacy_chat_body(ctx, False))
    message = body["completion_message"]
    expect(bool(message["content"]), f"empty legacy chat answer {body}")
    return f"{message['content']!r} (stop_reason={message.get('stop_reason')})"


def _legacy_chat_stream(ctx: HttpCtx, ndjson: bool) -> str:
    events = stream_events(ctx, "/inference/chat_completion", legacy_chat_body(ctx, True), ndjson)
    kinds = [e["event"]["event_type"] for e in events]
    expect(kinds[0] == "start" and kinds[-1] == "complete", f"event types {kinds}")
    text = "".join(_delta_text(e["event"]["delta"]) for e in events)
    expect(bool(text), "empty legacy chat stream")
    return f"{text!r} ({len(events)} events, stop_reason={events[-1]['event'].get('stop_reason')})"


def _delta_text(delta: object) -> str:
    return delta if isinstance(delta, str) else (delta or {}).get("text", "")  # 0.0.x bare strings, or typed


def check_legacy_chat_sse(ctx: HttpCtx) -> str:
    return _legacy_chat_stream(ctx, ndjson=False)


def check_legacy_chat_ndjson(ctx: HttpCtx) -> str:
    return _legacy_chat_stream(ctx, ndjson=True)


def check_legacy_completion(ctx: HttpCtx) -> str:
    body = http_json(ctx, "POST", "/inference/completion", legacy_completion_body(ctx, False))
    expect(bool(body["content"]), f"empty legacy completion {body}")
    return f"{body['content']!r} (stop_reason={body.get('stop_reason')})"


def _legacy_completion_stream(ctx: HttpCtx, ndjson: bool) -> str:
    events = stream_events(ctx, "/inference/completion", legacy_completion_body(ctx, True), ndjson)
    text = "".join(e.get("delta", "") for e in events)
    expect(bool(text) and events[-1].get("stop_reason"), f"bad legacy completion stream {events[-3:]}")
    return f"{text!r} ({len(events)} chunks, stop_reason={events[-1]['stop_reason']})"


def check_legacy_completion_sse(ctx: HttpCtx) -> str:
    return _legacy_completion_stream(ctx, ndjson=False)


def check_legacy_completion_ndjson(ctx: HttpCtx) -> str:
    return _legacy_completion_stream(ctx, ndjson=True)


def http_json(ctx: HttpCtx, method: str, path: str, body: dict | None = None) -> dict:
    r = ctx.http.request(method, path, json=body)
    expect(r.status_code == 200, f"{method} {path} -> {r.status_code} {r.text}")
    return r.json()


def stream_events(ctx: HttpCtx, path: str, body: dict, ndjson: bool) -> list[dict]:
    """The JSON events of one stream, SSE (`data: ...` lines) or NDJSON (one object per line)."""
    headers = {"Accept": "application/x-ndjson" if ndjson else "text/event-stream"}
    events = []
    with ctx.http.stream("POST", path, json=body, headers=headers) as r:
        expect(r.status_code == 200, f"POST {path} -> {r.status_code} {r.read().decode()}")
        kind = r.headers.get("content-type", "")
        expect(("ndjson" in kind) == ndjson, f"asked for {'NDJSON' if ndjson else 'SSE'}, got {kind}")
        for line in r.iter_lines():
            payload = line if ndjson else line.removeprefix("data: ") if line.startswith("data: ") else ""
            if payload.strip() and payload.strip() != "[DONE]":
                events.append(json.loads(payload))
    expect(bool(events) and not any("error" in e for e in events), f"stream events {events[-2:]}")
    return events


LLAMA_STACK_CHECKS: list[tuple[str, Callable[[Any], str]]] = [
    ("llama-stack /v1/health", check_llama_stack_health),
    ("llama-stack /v1/version", check_llama_stack_version),
    ("llama-stack /v1/providers", check_llama_stack_providers),
    ("legacy chat_completion", check_legacy_chat),
    ("legacy chat_completion SSE", check_legacy_chat_sse),
    ("legacy chat_completion NDJSON", check_legacy_chat_ndjson),
    ("legacy completion", check_legacy_completion),
    ("legacy completion SSE", check_legacy_completion_sse),
    ("legacy completion NDJSON", check_legacy_completion_ndjson),
]
