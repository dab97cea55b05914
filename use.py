"""Smoke client: call every route of a running Peregrine server and show what came back.

    python use.py --base-url http://127.0.0.1:8000 [--api-key KEY]

Each check is one small function in `CHECKS`; it prints what the server answered and raises on anything
wrong. The OpenAI routes go through the real `openai` SDK; the rest through httpx. Exit status: 0 when
every check passed, 1 otherwise. To cover a new route, write a check and append it to `CHECKS`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai

QUESTION = "What is the capital of France?"


@dataclass
class Ctx:
    """What the checks share: the clients, the served model id (set by `check_models`), the limits."""

    base_url: str
    api_key: str | None
    max_tokens: int
    http: httpx.Client
    client: openai.OpenAI
    model: str = ""
    embedding_model: str | None = None
    verbose: bool = False


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


# ---------------------------------------------------------------- checks


def check_health(ctx: Ctx) -> str:
    r = ctx.http.get("/health")
    _expect(r.status_code == 200, f"GET /health -> {r.status_code} {r.text}")
    return r.text


def check_ready(ctx: Ctx) -> str:
    r = ctx.http.get("/ready")
    _expect(r.status_code == 200, f"GET /ready -> {r.status_code} {r.text}")
    return r.text


def check_models(ctx: Ctx) -> str:
    models = ctx.client.models.list().data
    _expect(bool(models), "GET /v1/models returned no model")
    kinds = {m.id: (m.model_extra or {}).get("custom_metadata", {}).get("model_type", "llm") for m in models}
    ctx.model = next(i for i, kind in kinds.items() if kind == "llm")
    ctx.embedding_model = next((i for i, kind in kinds.items() if kind == "embedding"), None)
    return ", ".join(f"{i} ({kind})" for i, kind in kinds.items())


def check_model_detail(ctx: Ctx) -> str:
    r = ctx.http.get(f"/v1/models/{ctx.model}")
    _expect(r.status_code == 200, f"GET /v1/models/{ctx.model} -> {r.status_code} {r.text}")
    body = r.json()
    _expect(body.get("id") == ctx.model and body.get("identifier") == ctx.model, f"unexpected body {body}")
    summary = f"id={body['id']} model_type={body.get('model_type')} max_model_len={body.get('max_model_len')}"
    if ctx.embedding_model is not None:
        emb = http_json(ctx, "GET", f"/v1/models/{ctx.embedding_model}")
        _expect(emb.get("model_type") == "embedding", f"unexpected embedding model body {emb}")
        summary += f"; id={emb['id']} model_type=embedding"
    return summary


def check_chat(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    text = r.choices[0].message.content or ""
    _expect(bool(text.strip()), "empty chat answer")
    _expect(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
    _expect(r.usage is not None and r.usage.completion_tokens > 0, f"usage {r.usage}")
    return f"{text!r} (finish_reason={r.choices[0].finish_reason}, usage={r.usage.model_dump()})"


def check_chat_stream(ctx: Ctx) -> str:
    stream = ctx.client.chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=ctx.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text = "".join(pieces)
    _expect(bool(text.strip()), "empty streamed chat answer")
    _expect(finish in ("stop", "length"), f"finish_reason {finish}")
    _expect(usage is not None, "no usage chunk despite stream_options.include_usage")
    return f"{text!r} ({chunks} chunks, finish_reason={finish}, usage={usage.model_dump()})"


STRUCTURED_MAX_TOKENS = 120  # constrained answers end by themselves; this only bounds a runaway
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def check_chat_json_schema(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
    )
    choice = r.choices[0]
    _expect(choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}")
    answer = json.loads(choice.message.content or "")
    _expect(set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values()),
            f"answer does not match the schema: {answer}")
    return json.dumps(answer)


def check_chat_tool_call(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    choice = r.choices[0]
    _expect(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
    calls = choice.message.tool_calls or []
    _expect(len(calls) >= 1 and calls[0].function.name == "get_weather", f"tool_calls {calls}")
    arguments = json.loads(calls[0].function.arguments)
    _expect(isinstance(arguments.get("city"), str), f"arguments {arguments}")
    return f"{calls[0].function.name}({calls[0].function.arguments}) id={calls[0].id}"


def check_chat_tool_call_stream(ctx: Ctx) -> str:
    with ctx.client.chat.completions.stream(
        model=ctx.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    _expect(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
    call = (choice.message.tool_calls or [None])[0]
    _expect(call is not None and call.function.name == "get_weather", f"tool_calls {choice.message.tool_calls}")
    _expect(isinstance(json.loads(call.function.arguments).get("city"), str), f"arguments {call.function.arguments}")
    return f"{call.function.name}({call.function.arguments}) assembled from the stream"


def check_completion(ctx: Ctx) -> str:
    r = ctx.client.completions.create(
        model=ctx.model,
        prompt="The capital of France is",
        max_tokens=ctx.max_tokens,
        temperature=0,
        logprobs=1,
    )
    choice = r.choices[0]
    _expect(bool(choice.text), "empty completion")
    _expect(choice.logprobs is not None and len(choice.logprobs.tokens or []) > 0, "no logprobs")
    return f"{choice.text!r} (finish_reason={choice.finish_reason}, usage={r.usage.model_dump()})"


def check_completion_stream(ctx: Ctx) -> str:
    stream = ctx.client.completions.create(
        model=ctx.model,
        prompt="The capital of France is",
        max_tokens=ctx.max_tokens,
        temperature=0,
        stream=True,
    )
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    text = "".join(pieces)
    _expect(bool(text), "empty streamed completion")
    _expect(finish in ("stop", "length"), f"finish_reason {finish}")
    return f"{text!r} (finish_reason={finish})"


def check_completion_scoring(ctx: Ctx) -> str:
    """What evaluation tools send: echo + logprobs + max_tokens 0 scores the prompt's own tokens."""
    r = ctx.client.completions.create(
        model=ctx.model, prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    _expect(lp is not None and lp.token_logprobs[0] is None, f"no prompt logprobs: {lp}")
    _expect(all(x is not None for x in lp.token_logprobs[1:]), "a prompt token without a logprob")
    total = sum(lp.token_logprobs[1:])
    return f"{len(lp.tokens)} prompt tokens, sum logprob {total:.3f} (finish_reason={r.choices[0].finish_reason})"


def check_embeddings(ctx: Ctx) -> str:
    if ctx.embedding_model is None:  # started with --embedding-model none: the route must say so
        r = ctx.http.post("/v1/embeddings", json={"input": "hi"})
        _expect(r.status_code == 404 and "error" in r.json(), f"POST /v1/embeddings -> {r.status_code} {r.text}")
        return "no embedding model served (404 in the error envelope, as expected)"
    r = ctx.client.embeddings.create(model=ctx.embedding_model, input=["Falcons are fast.", "Peregrines dive."])
    dims = {len(d.embedding) for d in r.data}
    _expect(len(r.data) == 2 and len(dims) == 1 and dims.pop() > 0, f"bad embeddings {r}")
    return f"{ctx.embedding_model}: 2 vectors of {len(r.data[0].embedding)} (usage={r.usage.model_dump()})"


def check_tokenize(ctx: Ctx) -> str:
    text = http_json(ctx, "POST", "/tokenize", {"model": ctx.model, "prompt": QUESTION})
    _expect(text["count"] == len(text["tokens"]) > 0, f"bad /tokenize answer {text}")
    chat = http_json(ctx, "POST", "/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})
    _expect(chat["count"] > text["count"], "the chat template added no tokens")
    back = http_json(ctx, "POST", "/detokenize", {"tokens": text["tokens"]})
    _expect(back["prompt"] == QUESTION, f"/detokenize gave {back}")
    return f"text {text['count']} tokens, chat {chat['count']}, max_model_len {text['max_model_len']}"


def check_llama_stack_health(ctx: Ctx) -> str:
    return str(http_json(ctx, "GET", "/v1/health"))


def check_llama_stack_version(ctx: Ctx) -> str:
    return str(http_json(ctx, "GET", "/v1/version"))


def check_llama_stack_providers(ctx: Ctx) -> str:
    data = http_json(ctx, "GET", "/v1/providers")["data"]
    _expect(bool(data), "no provider listed")
    return ", ".join(f"{p['provider_id']} ({p['provider_type']}, {p['health']['status']})" for p in data)


def legacy_chat_body(ctx: Ctx, stream: bool) -> dict:
    return {"model_id": ctx.model, "messages": [{"role": "user", "content": QUESTION}], "stream": stream,
            "sampling_params": {"max_tokens": ctx.max_tokens, "strategy": {"type": "greedy"}}}


def legacy_completion_body(ctx: Ctx, stream: bool) -> dict:
    return {"model_id": ctx.model, "content": "The capital of France is", "stream": stream,
            "sampling_params": {"max_tokens": ctx.max_tokens, "strategy": {"type": "greedy"}}}


def check_legacy_chat(ctx: Ctx) -> str:
    body = http_json(ctx, "POST", "/inference/chat_completion", legacy_chat_body(ctx, False))
    message = body["completion_message"]
    _expect(bool(message["content"]), f"empty legacy chat answer {body}")
    return f"{message['content']!r} (stop_reason={message.get('stop_reason')})"


def _legacy_chat_stream(ctx: Ctx, ndjson: bool) -> str:
    events = stream_events(ctx, "/inference/chat_completion", legacy_chat_body(ctx, True), ndjson)
    kinds = [e["event"]["event_type"] for e in events]
    _expect(kinds[0] == "start" and kinds[-1] == "complete", f"event types {kinds}")
    text = "".join(_delta_text(e["event"]["delta"]) for e in events)
    _expect(bool(text), "empty legacy chat stream")
    return f"{text!r} ({len(events)} events, stop_reason={events[-1]['event'].get('stop_reason')})"


def _delta_text(delta: object) -> str:
    return delta if isinstance(delta, str) else (delta or {}).get("text", "")  # 0.0.x bare strings, or typed


def check_legacy_chat_sse(ctx: Ctx) -> str:
    return _legacy_chat_stream(ctx, ndjson=False)


def check_legacy_chat_ndjson(ctx: Ctx) -> str:
    return _legacy_chat_stream(ctx, ndjson=True)


def check_legacy_completion(ctx: Ctx) -> str:
    body = http_json(ctx, "POST", "/inference/completion", legacy_completion_body(ctx, False))
    _expect(bool(body["content"]), f"empty legacy completion {body}")
    return f"{body['content']!r} (stop_reason={body.get('stop_reason')})"


def _legacy_completion_stream(ctx: Ctx, ndjson: bool) -> str:
    events = stream_events(ctx, "/inference/completion", legacy_completion_body(ctx, True), ndjson)
    text = "".join(e.get("delta", "") for e in events)
    _expect(bool(text) and events[-1].get("stop_reason"), f"bad legacy completion stream {events[-3:]}")
    return f"{text!r} ({len(events)} chunks, stop_reason={events[-1]['stop_reason']})"


def check_legacy_completion_sse(ctx: Ctx) -> str:
    return _legacy_completion_stream(ctx, ndjson=False)


def check_legacy_completion_ndjson(ctx: Ctx) -> str:
    return _legacy_completion_stream(ctx, ndjson=True)


def http_json(ctx: Ctx, method: str, path: str, body: dict | None = None) -> dict:
    r = ctx.http.request(method, path, json=body)
    _expect(r.status_code == 200, f"{method} {path} -> {r.status_code} {r.text}")
    return r.json()


def stream_events(ctx: Ctx, path: str, body: dict, ndjson: bool) -> list[dict]:
    """The JSON events of one stream, SSE (`data: ...` lines) or NDJSON (one object per line)."""
    headers = {"Accept": "application/x-ndjson" if ndjson else "text/event-stream"}
    events = []
    with ctx.http.stream("POST", path, json=body, headers=headers) as r:
        _expect(r.status_code == 200, f"POST {path} -> {r.status_code} {r.read().decode()}")
        kind = r.headers.get("content-type", "")
        _expect(("ndjson" in kind) == ndjson, f"asked for {'NDJSON' if ndjson else 'SSE'}, got {kind}")
        for line in r.iter_lines():
            payload = line if ndjson else line.removeprefix("data: ") if line.startswith("data: ") else ""
            if payload.strip() and payload.strip() != "[DONE]":
                events.append(json.loads(payload))
    _expect(bool(events) and not any("error" in e for e in events), f"stream events {events[-2:]}")
    return events


def check_error_envelope(ctx: Ctx) -> str:
    try:
        ctx.client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    except openai.NotFoundError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        _expect("message" in body, f"no OpenAI error envelope: {exc.body}")
        return f"404 {body.get('message')}"
    raise AssertionError("an unknown model was accepted")


Check = Callable[[Ctx], str]
CHECKS: list[tuple[str, Check]] = [
    ("health", check_health),
    ("ready", check_ready),
    ("models", check_models),
    ("models/{id}", check_model_detail),
    ("chat", check_chat),
    ("chat stream", check_chat_stream),
    ("chat json_schema", check_chat_json_schema),
    ("chat tool call", check_chat_tool_call),
    ("chat tool call stream", check_chat_tool_call_stream),
    ("completions", check_completion),
    ("completions stream", check_completion_stream),
    ("completions scoring (echo, max_tokens 0)", check_completion_scoring),
    ("embeddings", check_embeddings),
    ("tokenize + detokenize", check_tokenize),
    ("llama-stack /v1/health", check_llama_stack_health),
    ("llama-stack /v1/version", check_llama_stack_version),
    ("llama-stack /v1/providers", check_llama_stack_providers),
    ("legacy chat_completion", check_legacy_chat),
    ("legacy chat_completion SSE", check_legacy_chat_sse),
    ("legacy chat_completion NDJSON", check_legacy_chat_ndjson),
    ("legacy completion", check_legacy_completion),
    ("legacy completion SSE", check_legacy_completion_sse),
    ("legacy completion NDJSON", check_legacy_completion_ndjson),
    ("unknown model -> 404", check_error_envelope),
]


# ---------------------------------------------------------------- runner


def run(ctx: Ctx, checks: list[tuple[str, Check]]) -> int:
    failed = 0
    for name, check in checks:
        start = time.perf_counter()
        try:
            summary = check(ctx)
        except Exception as exc:  # noqa: BLE001 - report every failure, then go on
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            if ctx.verbose:
                traceback.print_exc()
            continue
        print(f"ok   {name} ({time.perf_counter() - start:.1f}s): {summary}")
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server root (no /v1)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("-v", action="store_true", help="print tracebacks of failures")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=base, headers=headers, timeout=args.timeout) as http:
        client = openai.OpenAI(
            base_url=f"{base}/v1", api_key=args.api_key or "none", timeout=args.timeout, max_retries=0
        )
        ctx = Ctx(base, args.api_key, args.max_tokens, http, client, verbose=args.v)
        return run(ctx, CHECKS)


if __name__ == "__main__":
    sys.exit(main())
