"""Smoke client: call every route of a running Peregrine server and show what came back.

    python use.py --base-url http://127.0.0.1:8000 [--api-key KEY]

Each check is one small function in `CHECKS`; it prints what the server answered and raises on anything
wrong. The OpenAI routes go through the real `openai` SDK; the rest through httpx. Exit status: 0 when
every check passed, 1 otherwise. To cover a new route, write a check and append it to `CHECKS`.
"""

from __future__ import annotations

import argparse
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
    ctx.model = models[0].id
    return ", ".join(m.id for m in models)


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
    ("chat", check_chat),
    ("chat stream", check_chat_stream),
    ("completions", check_completion),
    ("completions stream", check_completion_stream),
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
