"""Request limits, as one ASGI middleware: what a request may cost before the routes see it.

In order, for every route but the health ones:

1. Draining (shutdown under way): 503 with `Retry-After`, so a load balancer retries elsewhere.
2. Admission control for generation routes (the routes marked with `app.deps.generates`, collected from the
   routers by `create_app`, so a new route or prefix needs no second list here): at most `limit` generation requests (`max_num_seqs +
   max_queue`: a full batch plus a bounded waiting queue) are admitted at once, counted from the moment
   their headers arrive. The next one is refused at once with 429 and `Retry-After`, before its body is
   read, rather than queued without bound; every admitted request runs to completion.
3. Body size: a `Content-Length` over `max_body_bytes`, or a body that grows past it, is refused with 413
   before it is buffered whole.
4. Body encoding: a JSON body must be UTF-8 and parse as JSON; otherwise 400 with the position of the fault
   (FastAPI would otherwise answer non-UTF-8 with a vague message, and deep nesting with a 500).
5. Generation routes run under `request_timeout` (seconds, from the headers to the last byte, streaming
   included) and are cancelled as soon as the client disconnects, whether it is waiting for a
   non-streaming answer or reading a stream. Cancellation reaches the route's `finally`, which aborts the
   engine request, so its KV memory is freed within one engine step. A body still uploading at the
   deadline gets 408; a timeout before the response started answers 504; after a stream started it goes
   out as one last error event and the stream ends.

Errors use the OpenAI envelope (`app/errors.py`), written here with `send_error` because middlewares sit
outside FastAPI's exception handlers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from app.errors import error_body

log = logging.getLogger("peregrine.limits")

OPEN_PATHS = frozenset({"/health", "/ready", "/v1/health", "/"})
OPEN_PREFIXES = ("/health/", "/ui/")
"""Health routes: never authenticated, limited or drained away, so probes always get an answer. The chat
page (`/` and its static files under `/ui/`, app/ui/__init__.py) is open too: it holds no secret and asks for the key."""

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
RETRY_AFTER_S = 1


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def generation_paths(routes: Iterable[object]) -> frozenset[str]:
    """The paths of the routes that run the engine: those whose endpoint is marked `generates` (app/deps.py)."""
    return frozenset(
        str(getattr(r, "path", "")) for r in routes if getattr(getattr(r, "endpoint", None), "generates", False)
    )


def is_generation_route(method: str, path: str, paths: Collection[str]) -> bool:
    return method == "POST" and (path.rstrip("/") or "/") in paths


async def send_error(
    send,
    status: int,
    message: str,
    error_type: str,
    code: str | int | None,
    headers: Iterable[tuple[bytes, bytes]] = (),
    param: str | None = None,
) -> None:
    """Answer a raw ASGI request with the OpenAI error envelope."""
    body = json.dumps(error_body(message, error_type, param, code)).encode()
    all_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


class Admission:
    """A counter of admitted generation requests with a hard limit; `try_enter` never waits.

    `active` counts every guarded request in flight (generation or not): a drain waits for it to reach 0.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.active = 0
        self.refused_total = 0

    def try_enter(self) -> bool:
        if self.limit > 0 and self.in_flight >= self.limit:
            self.refused_total += 1
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1


@dataclass(slots=True)
class Rejection(Exception):
    status: int
    message: str
    code: str
    error_type: str = "invalid_request_error"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class _Exchange:
    """What one request's response has done so far, seen through the wrapped `send`."""

    started: bool = False
    complete: bool = False
    content_type: str = ""
    timed_out: bool = False
    disconnected: bool = False


class LimitsMiddleware:
    """See the module docstring. `draining` is polled per request (True once shutdown began)."""

    def __init__(
        self,
        app,
        *,
        max_body_bytes: int,
        admission: Admission,
        request_timeout: float | None = None,
        draining: Callable[[], bool] = lambda: False,
        generation: Collection[str] = frozenset(),
    ) -> None:
        self.app = app
        self.generation = generation  # paths of the routes that run the engine (`generation_paths`)
        self.max_body_bytes = max_body_bytes
        self.admission = admission
        self.request_timeout = request_timeout if request_timeout and request_timeout > 0 else None
        self.draining = draining

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or is_open_path(route_path(scope)):
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], route_path(scope)
        generation = is_generation_route(method, path, self.generation)
        try:
            self._admit(generation)
        except Rejection as r:
            await send_error(send, r.status, r.message, r.error_type, r.code, r.headers)
            return
        self.admission.active += 1
        deadline = None
        if generation and self.request_timeout is not None:
            deadline = asyncio.get_running_loop().time() + self.request_timeout
        try:
            await self._serve(scope, receive, send, deadline)
        finally:
            self.admission.active -= 1
            if generation:
                self.admission.leave()

    def _admit(self, generation: bool) -> None:
        retry = [(b"retry-after", str(RETRY_AFTER_S).encode())]
        if self.draining():
            raise Rejection(
                503,
                "The server is shutting down; retry on another replica.",
                "server_shutting_down",
                "service_unavailable",
                retry,
            )
        if generation and not self.admission.try_enter():
            message = f"The server is at capacity ({self.admission.limit} generation requests in flight); retry shortly."
            raise Rejection(429, message, "server_overloaded", "rate_limit_error", retry)

    async def _serve(self, scope, receive, send, deadline: float | None) -> None:
        """Buffer and check the body (within the deadline: a slow upload must not hold a slot forever)."""
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    body = await self._read_body(scope, receive)
            except TimeoutError:
                raise Rejection(
                    408, self._timeout_message("the request body did not arrive"), "request_timeout"
                ) from None
            if body is None:  # the client left while sending
                return
            _check_json(scope, body)
        except Rejection as r:
            await send_error(send, r.status, r.message, r.error_type, r.code, r.headers)
            return
        await self._run(scope, body, receive, send, deadline)

    async def _read_body(self, scope, receive) -> bytes | None:
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(int(declared), self.max_body_bytes)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(size, self.max_body_bytes, at_least=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _run(self, scope, body: bytes, receive, send, deadline: float | None) -> None:
        """Run the app with the buffered body; cancel it on disconnect, or at the deadline (generation)."""
        state = _Exchange()
        gone = asyncio.Event()
        replayed = False

        async def app_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def app_send(message) -> None:
            if message["type"] == "http.response.start":
                state.started = True
                state.content_type = (header(message, b"content-type") or "").lower()
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state.complete = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, app_receive, app_send))

        def stop(reason: str) -> None:
            if task.done() or state.complete:
                return
            setattr(state, reason, True)
            task.cancel()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            stop("disconnected")

        watcher = asyncio.ensure_future(watch())
        timer = None if deadline is None else asyncio.get_running_loop().call_at(deadline, stop, "timed_out")
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the server is cancelling us: not ours to handle
            if state.timed_out:
                await self._send_timeout(send, state)
        finally:
            if timer is not None:
                timer.cancel()
            for t in (task, watcher):
                t.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)

    def _timeout_message(self, what: str) -> str:
        return f"Timed out: {what} within the server's request_timeout ({self.request_timeout:g} s)."

    async def _send_timeout(self, send, state: _Exchange) -> None:
        message = self._timeout_message("the request did not finish")
        log.warning("request timed out after %g s", self.request_timeout)
        if not state.started:
            await send_error(send, 504, message, "timeout_error", "request_timeout")
            return
        if state.complete:
            return
        event = json.dumps(error_body(message, "timeout_error", None, "request_timeout"))
        if "text/event-stream" in state.content_type:
            chunk = f"data: {event}\n\n".encode()
        elif "ndjson" in state.content_type:
            chunk = f"{event}\n".encode()
        else:
            chunk = b""  # a non-stream body was cut mid-way: nothing sensible to add
        await send({"type": "http.response.body", "body": chunk, "more_body": False})


def _too_large(size: int, limit: int, at_least: bool = False) -> Rejection:
    size_text = f"at least {size}" if at_least else str(size)
    message = (
        f"The request body is too large: {size_text} bytes; the limit is {limit} bytes (max_body_bytes)."
    )
    return Rejection(413, message, "request_too_large")


def _check_json(scope, body: bytes) -> None:
    """A JSON body (declared, or undeclared) must be UTF-8 and parse; say where it does not."""
    content_type = (header(scope, b"content-type") or "application/json").split(";")[0].strip().lower()
    if not body or not (content_type == "application/json" or content_type.endswith("+json")):
        return
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejection(
            400,
            f"The request body is not valid UTF-8 (byte {exc.start}): JSON must be UTF-8.",
            "invalid_encoding",
        ) from None
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise Rejection(
            400,
            f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).",
            "invalid_json",
        ) from None
    except RecursionError:
        raise Rejection(
            400, "The request body is not valid JSON: it is nested too deeply.", "invalid_json"
        ) from None


def route_path(scope) -> str:
    """The path without the mount prefix (`root_path`), as routes see it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


def header(scope_or_message, name: bytes) -> str | None:
    for key, value in scope_or_message.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
