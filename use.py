"""Smoke client: call every route of a running Peregrine server and show what came back.

    python use.py --base-url http://127.0.0.1:8000 [--api-key KEY]

Each check is one small function in `CHECKS` (the Llama Stack ones in `use_llama_stack.py`, Anthropic's in
`use_anthropic.py`); it prints what the server answered and raises on anything
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

from use_anthropic import ANTHROPIC_CHECKS
from use_llama_stack import LLAMA_STACK_CHECKS, QUESTION, expect, http_json
from use_ollama import OLLAMA_CHECKS
from use_responses import RESPONSES_CHECKS


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


# ---------------------------------------------------------------- checks


def check_health(ctx: Ctx) -> str:
    r = ctx.http.get("/health")
    expect(r.status_code == 200, f"GET /health -> {r.status_code} {r.text}")
    return r.text


def check_ready(ctx: Ctx) -> str:
    r = ctx.http.get("/ready")
    expect(r.status_code == 200, f"GET /ready -> {r.status_code} {r.text}")
    return r.text


def check_models(ctx: Ctx) -> str:
    models = ctx.client.models.list().data
    expect(bool(models), "GET /v1/models returned no model")
    kinds = {m.id: (m.model_extra or {}).get("custom_metadata", {}).get("model_type", "llm") for m in models}
    ctx.model = next(i for i, kind in kinds.items() if kind == "llm")
    ctx.embedding_model = next((i for i, kind in kinds.items() if kind == "embedding"), None)
    return ", ".join(f"{i} ({kind})" for i, kind in kinds.items())


def check_model_detail(ctx: Ctx) -> str:
    r = ctx.http.get(f"/v1/models/{ctx.model}")
    expect(r.status_code == 200, f"GET /v1/models/{ctx.model} -> {r.status_code} {r.text}")
    body = r.json()
    expect(body.get("id") == ctx.model and body.get("identifier") == ctx.model, f"unexpected body {body}")
    summary = f"id={body['id']} model_type={body.get('model_type')} max_model_len={body.get('max_model_len')}"
    if ctx.embedding_model is not None:
        emb = http_json(ctx, "GET", f"/v1/models/{ctx.embedding_model}")
        expect(emb.get("model_type") == "embedding", f"unexpected embedding model body {emb}")
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
    expect(bool(text.strip()), "empty chat answer")
    expect(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
    expect(r.usage is not None and r.usage.completion_tokens > 0, f"usage {r.usage}")
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
    expect(bool(text.strip()), "empty streamed chat answer")
    expect(finish in ("stop", "length"), f"finish_reason {finish}")
    expect(usage is not None, "no usage chunk despite stream_options.include_usage")
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
    expect(choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}")
    answer = json.loads(choice.message.content or "")
    expect(set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values()),
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
    expect(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
    calls = choice.message.tool_calls or []
    expect(len(calls) >= 1 and calls[0].function.name == "get_weather", f"tool_calls {calls}")
    arguments = json.loads(calls[0].function.arguments)
    expect(isinstance(arguments.get("city"), str), f"arguments {arguments}")
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
    expect(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
    call = (choice.message.tool_calls or [None])[0]
    expect(call is not None and call.function.name == "get_weather", f"tool_calls {choice.message.tool_calls}")
    expect(isinstance(json.loads(call.function.arguments).get("city"), str), f"arguments {call.function.arguments}")
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
    expect(bool(choice.text), "empty completion")
    expect(choice.logprobs is not None and len(choice.logprobs.tokens or []) > 0, "no logprobs")
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
    expect(bool(text), "empty streamed completion")
    expect(finish in ("stop", "length"), f"finish_reason {finish}")
    return f"{text!r} (finish_reason={finish})"


def check_completion_scoring(ctx: Ctx) -> str:
    """What evaluation tools send: echo + logprobs + max_tokens 0 scores the prompt's own tokens."""
    r = ctx.client.completions.create(
        model=ctx.model, prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    expect(lp is not None and lp.token_logprobs[0] is None, f"no prompt logprobs: {lp}")
    expect(all(x is not None for x in lp.token_logprobs[1:]), "a prompt token without a logprob")
    total = sum(lp.token_logprobs[1:])
    return f"{len(lp.tokens)} prompt tokens, sum logprob {total:.3f} (finish_reason={r.choices[0].finish_reason})"


def check_embeddings(ctx: Ctx) -> str:
    if ctx.embedding_model is None:  # started with --embedding-model none: the route must say so
        r = ctx.http.post("/v1/embeddings", json={"input": "hi"})
        expect(r.status_code == 404 and "error" in r.json(), f"POST /v1/embeddings -> {r.status_code} {r.text}")
        return "no embedding model served (404 in the error envelope, as expected)"
    r = ctx.client.embeddings.create(model=ctx.embedding_model, input=["Falcons are fast.", "Peregrines dive."])
    dims = {len(d.embedding) for d in r.data}
    expect(len(r.data) == 2 and len(dims) == 1 and dims.pop() > 0, f"bad embeddings {r}")
    return f"{ctx.embedding_model}: 2 vectors of {len(r.data[0].embedding)} (usage={r.usage.model_dump()})"


def check_tokenize(ctx: Ctx) -> str:
    text = http_json(ctx, "POST", "/tokenize", {"model": ctx.model, "prompt": QUESTION})
    expect(text["count"] == len(text["tokens"]) > 0, f"bad /tokenize answer {text}")
    chat = http_json(ctx, "POST", "/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})
    expect(chat["count"] > text["count"], "the chat template added no tokens")
    back = http_json(ctx, "POST", "/detokenize", {"tokens": text["tokens"]})
    expect(back["prompt"] == QUESTION, f"/detokenize gave {back}")
    return f"text {text['count']} tokens, chat {chat['count']}, max_model_len {text['max_model_len']}"


def check_error_envelope(ctx: Ctx) -> str:
    try:
        ctx.client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    except openai.NotFoundError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        expect("message" in body, f"no OpenAI error envelope: {exc.body}")
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
    *LLAMA_STACK_CHECKS,
    *RESPONSES_CHECKS,
    *OLLAMA_CHECKS,
    *ANTHROPIC_CHECKS,
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
