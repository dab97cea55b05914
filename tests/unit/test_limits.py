"""The limits middleware: body size, body encoding, admission, timeout, disconnect, draining (no model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from app.deps import generates
from app.limits import Admission, LimitsMiddleware, generation_paths, is_generation_route, is_open_path

LIMIT = 1024


class Probe:
    """Lets a test hold a route open, and tells whether the route was cancelled (its `finally` ran)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()


def make_app(
    probe: Probe,
    *,
    limit: int = 8,
    timeout: float | None = None,
    draining: list[bool] | None = None,
    max_body: int = LIMIT,
):
    api = FastAPI()
    flag = draining if draining is not None else [False]

    @api.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    @api.post("/v1/echo")
    async def echo(request: Request) -> dict:
        return {"keys": sorted(await request.json())}

    @api.post("/v1/chat/completions")
    @generates
    async def chat(request: Request):
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(_events(probe), media_type="text/event-stream")
        probe.entered.set()
        try:
            if body.get("hold"):
                await probe.release.wait()
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        return {"ok": True}

    admission = Admission(limit)
    api.add_middleware(
        LimitsMiddleware,
        max_body_bytes=max_body,
        admission=admission,
        request_timeout=timeout,
        draining=lambda: flag[0],
        generation=generation_paths(api.routes),
    )
    return api, admission


async def _events(probe: Probe):
    try:
        yield b'data: {"n": 1}\n\n'
        probe.entered.set()
        await probe.release.wait()
        yield b"data: [DONE]\n\n"
    finally:  # closed or cancelled before the release: the route was stopped from outside
        if not probe.release.is_set():
            probe.cancelled.set()


def client(api: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://test")


def envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_route_classification() -> None:
    from app.llama_stack import routes as llama_stack
    from app.openai import routes as openai_routes

    paths = generation_paths([*openai_routes.router.routes, *llama_stack.router.routes])  # marked `generates`
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/inference/chat_completion",
        "/inference/completion",
        "/alpha/inference/chat-completion",
        "/v1/inference/chat-completion",
        "/v1/inference/batch-chat-completion",
        "/v1/inference/batch-completion",
    ):
        assert is_generation_route("POST", path, paths), path
    for method, path in (("GET", "/v1/chat/completions"), ("POST", "/v1/embeddings"), ("GET", "/v1/models"),
                         ("POST", "/v1/inference/embeddings"), ("POST", "/tokenize")):
        assert not is_generation_route(method, path, paths)
    assert is_open_path("/health") and is_open_path("/health/engine") and is_open_path("/v1/health")
    assert is_open_path("/ready") and not is_open_path("/healthz") and not is_open_path("/v1/models")


async def test_declared_oversized_body_is_413() -> None:
    api, _ = make_app(Probe())
    async with client(api) as c:
        response = await c.post(
            "/v1/echo", content=b"{" + b" " * LIMIT + b"}", headers={"content-type": "application/json"}
        )
    error = envelope(response, 413)
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]


async def test_streamed_oversized_body_without_length_is_413() -> None:
    async def chunks():
        for _ in range(4):
            yield b" " * (LIMIT // 2)

    api, _ = make_app(Probe())
    async with client(api) as c:
        response = await c.post("/v1/echo", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert envelope(response, 413)["code"] == "request_too_large"


async def test_body_at_the_limit_passes() -> None:
    body = json.dumps({"a": "x" * (LIMIT - 20)}).encode()
    body += b" " * (LIMIT - len(body))
    assert len(body) == LIMIT
    api, _ = make_app(Probe())
    async with client(api) as c:
        response = await c.post("/v1/echo", content=body, headers={"content-type": "application/json"})
    assert response.json() == {"keys": ["a"]}


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (b'{"a": "\xff\xfe"}', "invalid_encoding", "UTF-8"),
        (b'{"a": 1,}', "invalid_json", "line 1"),
        (b'{"a": ', "invalid_json", "not valid JSON"),
    ],
)
async def test_bad_json_bodies_are_400(body: bytes, code: str, words: str) -> None:
    api, _ = make_app(Probe())
    async with client(api) as c:
        for content_type in ("application/json", "application/json; charset=utf-8", None):
            headers = {"content-type": content_type} if content_type else {}
            response = await c.post("/v1/echo", content=body, headers=headers)
            error = envelope(response, 400)
            assert error["code"] == code and words in error["message"]


async def test_deeply_nested_json_is_refused_not_crashed() -> None:
    body = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    api, _ = make_app(Probe(), max_body=len(body))
    async with client(api) as c:
        response = await c.post("/v1/echo", content=body, headers={"content-type": "application/json"})
    assert envelope(response, 400)["code"] == "invalid_json"


async def test_draining_refuses_everything_but_health() -> None:
    draining = [True]
    api, _ = make_app(Probe(), draining=draining)
    async with client(api) as c:
        assert (await c.get("/health")).status_code == 200
        for response in (await c.get("/v1/models"), await c.post("/v1/chat/completions", json={})):
            assert envelope(response, 503)["code"] == "server_shutting_down"
            assert response.headers["retry-after"] == "1"
        draining[0] = False
        assert (await c.get("/v1/models")).status_code == 200


async def test_admission_refuses_at_once_beyond_the_limit_and_admitted_requests_complete() -> None:
    probe = Probe()
    api, admission = make_app(probe, limit=2)
    async with client(api) as c:
        held = [asyncio.create_task(c.post("/v1/chat/completions", json={"hold": True})) for _ in range(2)]
        await asyncio.wait_for(_until(lambda: admission.in_flight == 2), 30)
        refused = await c.post("/v1/chat/completions", json={})
        assert envelope(refused, 429)["code"] == "server_overloaded"
        assert refused.headers["retry-after"] == "1"
        assert (await c.get("/v1/models")).status_code == 200, "only generation routes are counted"
        probe.release.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        assert admission.in_flight == 0 and admission.refused_total == 1
        assert (await c.post("/v1/chat/completions", json={})).status_code == 200


async def test_admission_slot_is_released_when_the_route_fails() -> None:
    admission = Admission(1)

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    middleware = LimitsMiddleware(broken, max_body_bytes=LIMIT, admission=admission,
                                  generation={"/v1/completions"})
    with pytest.raises(RuntimeError):
        await middleware(_scope("/v1/completions"), _receiver([b"{}"]), _sink([]))
    assert admission.in_flight == 0


async def test_timeout_before_the_response_is_504_and_cancels_the_route() -> None:
    probe = Probe()
    api, admission = make_app(probe, timeout=0.2)
    async with client(api) as c:
        response = await c.post("/v1/chat/completions", json={"hold": True})
    error = envelope(response, 504)
    assert error["code"] == "request_timeout" and "request_timeout" in error["message"]
    assert probe.cancelled.is_set()
    assert admission.in_flight == 0


async def test_timeout_mid_stream_ends_the_stream_with_one_error_event() -> None:
    probe = Probe()
    api, _ = make_app(probe, timeout=0.2)
    async with client(api) as c:
        response = await c.post("/v1/chat/completions", json={"stream": True})
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert events[0] == 'data: {"n": 1}'
    assert len(events) == 2 and "[DONE]" not in response.text
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "request_timeout"
    assert probe.cancelled.is_set()


async def test_timeout_does_not_apply_to_other_routes() -> None:
    api, _ = make_app(Probe(), timeout=0.01)
    async with client(api) as c:
        assert (await c.post("/v1/echo", json={"a": 1})).status_code == 200


def _scope(path: str, method: str = "POST") -> dict:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "scheme": "http",
        "http_version": "1.1",
        "asgi": {"version": "3.0"},
    }


def _receiver(chunks: list[bytes], gone: asyncio.Event | None = None):
    """A server's `receive`: the body in chunks, then `http.disconnect` once `gone` is set."""
    queue = list(chunks)

    async def receive():
        if queue:
            chunk = queue.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(queue)}
        if gone is not None:
            await gone.wait()
        else:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


def _sink(messages: list[dict]):
    async def send(message):
        messages.append(message)

    return send


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_cancels_the_route(stream: bool) -> None:
    probe = Probe()
    api, admission = make_app(probe)
    gone = asyncio.Event()
    body = json.dumps({"hold": True, "stream": stream}).encode()
    sent: list[dict] = []
    middleware = api.build_middleware_stack()
    call = asyncio.create_task(
        middleware(_scope("/v1/chat/completions"), _receiver([body], gone), _sink(sent))
    )
    await asyncio.wait_for(probe.entered.wait(), 30)
    assert admission.in_flight == 1
    gone.set()
    await asyncio.wait_for(call, 30)
    assert probe.cancelled.is_set(), "the route saw the cancellation (where it aborts its engine request)"
    assert admission.in_flight == 0
    assert not any(m.get("status") == 504 for m in sent)


async def test_client_gone_while_sending_the_body_stops_quietly() -> None:
    api, admission = make_app(Probe())
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    await api.build_middleware_stack()(_scope("/v1/chat/completions"), receive, _sink(sent))
    assert sent == [] and admission.in_flight == 0


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


async def test_slow_upload_of_a_generation_request_is_408_and_frees_its_slot() -> None:
    admission = Admission(1)
    reached = asyncio.Event()

    async def never(scope, receive, send):
        reached.set()

    middleware = LimitsMiddleware(never, max_body_bytes=LIMIT, admission=admission, request_timeout=0.2,
                                  generation={"/v1/completions"})
    first_chunk_only = _receiver([b'{"prompt": ', b"never sent"], gone=asyncio.Event())

    async def stalled_receive():
        message = await first_chunk_only()
        if message["body"] != b'{"prompt": ':
            await asyncio.Event().wait()  # the rest of the body never arrives
        return message

    sent: list[dict] = []
    await asyncio.wait_for(middleware(_scope("/v1/completions"), stalled_receive, _sink(sent)), 30)
    assert sent[0]["status"] == 408 and not reached.is_set()
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"
    assert admission.in_flight == 0 and admission.active == 0
