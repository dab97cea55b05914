"""use.py's checks of Ollama's API (/api/*), over httpx: each route once, streams (NDJSON) and not."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from use_llama_stack import QUESTION, expect

if TYPE_CHECKING:
    from use import Ctx


def _post(ctx: Ctx, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = ctx.http.post(route, json={"stream": False, **body})
    expect(r.status_code == 200, f"POST {route} -> {r.status_code} {r.text}")
    return r.json()


def _stream(ctx: Ctx, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with ctx.http.stream("POST", route, json={"stream": True, **body}) as r:
        expect(r.status_code == 200, f"POST {route} (stream) -> {r.status_code}")
        expect(r.headers["content-type"].startswith("application/x-ndjson"), f"not NDJSON: {r.headers}")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    expect(bool(lines) and lines[-1].get("done") is True, f"no done line: {lines[-1:]}")
    expect("error" not in lines[-1], f"error line: {lines[-1]}")
    return lines


def _options(ctx: Ctx) -> dict[str, Any]:
    return {"num_predict": ctx.max_tokens, "temperature": 0}


def check_liveness(ctx: Ctx) -> str:
    r = ctx.http.get("/", headers={"Accept": "*/*"})
    expect(r.text == "Ollama is running", f"GET / -> {r.status_code} {r.text[:80]}")
    version = ctx.http.get("/api/version").json()["version"]
    return f"GET / says {r.text!r}, /api/version {version}"


def check_tags_ps(ctx: Ctx) -> str:
    tags = ctx.http.get("/api/tags").json()["models"]
    expect(any(m["name"] == ctx.model for m in tags), f"{ctx.model} not in /api/tags: {tags}")
    ps = ctx.http.get("/api/ps").json()["models"]
    return f"tags {[m['name'] for m in tags]}, loaded {[m['name'] for m in ps]}"


def check_show(ctx: Ctx) -> str:
    shown = _post(ctx, "/api/show", {"model": ctx.model})
    arch = shown["model_info"]["general.architecture"]
    return f"{arch}, context {shown['model_info'][f'{arch}.context_length']}, {shown['details']['parameter_size']}"


def check_chat(ctx: Ctx) -> str:
    body = {"model": ctx.model, "messages": [{"role": "user", "content": QUESTION}], "options": _options(ctx)}
    answer = _post(ctx, "/api/chat", body)
    expect(answer["done"] and answer["eval_count"] > 0, f"bad /api/chat answer {answer}")
    return f"{answer['message']['content']!r} ({answer['done_reason']}, {answer['eval_count']} tokens)"


def check_chat_stream(ctx: Ctx) -> str:
    body = {"model": ctx.model, "messages": [{"role": "user", "content": QUESTION}], "options": _options(ctx)}
    lines = _stream(ctx, "/api/chat", body)
    text = "".join(line["message"]["content"] for line in lines)
    return f"{len(lines)} lines: {text!r}"


def check_generate(ctx: Ctx) -> str:
    answer = _post(ctx, "/api/generate", {"model": ctx.model, "prompt": QUESTION, "options": _options(ctx),
                                          "format": "json"})  # fmt: skip
    expect(answer["response"].lstrip().startswith("{"), f"format json gave {answer['response']!r}")
    return f"format json: {answer['response']!r}"


def check_generate_stream(ctx: Ctx) -> str:
    lines = _stream(ctx, "/api/generate", {"model": ctx.model, "prompt": "Once upon a time", "raw": True,
                                           "options": _options(ctx)})  # fmt: skip
    return f"raw: {''.join(line['response'] for line in lines)!r}"


def check_embed(ctx: Ctx) -> str:
    if ctx.embedding_model is None:
        return "no embedding model served"
    out = _post(ctx, "/api/embed", {"model": ctx.embedding_model, "input": ["Falcons are fast.", "Peregrines dive."]})
    expect(len(out["embeddings"]) == 2, f"bad /api/embed answer {str(out)[:200]}")
    return f"2 vectors of {len(out['embeddings'][0])}"


def check_pull(ctx: Ctx) -> str:
    with ctx.http.stream("POST", "/api/pull", json={"model": "bundled:smollm2"}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]  # progress lines: no `done`, `success` last
    expect(bool(lines) and lines[-1] == {"status": "success"}, f"pull gave {lines}")
    return " -> ".join(line["status"] for line in lines)


def check_ollama_error(ctx: Ctx) -> str:
    r = ctx.http.post("/api/chat", json={"model": "no-such-model", "messages": []})
    expect(r.status_code == 404 and isinstance(r.json().get("error"), str), f"{r.status_code} {r.text}")
    return f"404 {r.json()['error']}"


OLLAMA_CHECKS = [
    ("ollama GET / + /api/version", check_liveness),
    ("ollama /api/tags + /api/ps", check_tags_ps),
    ("ollama /api/show", check_show),
    ("ollama /api/chat", check_chat),
    ("ollama /api/chat stream", check_chat_stream),
    ("ollama /api/generate format json", check_generate),
    ("ollama /api/generate raw stream", check_generate_stream),
    ("ollama /api/embed", check_embed),
    ("ollama /api/pull (bundled, nothing fetched)", check_pull),
    ("ollama unknown model -> 404", check_ollama_error),
]
