"""Ollama's error envelope, `{"error": "..."}`, for the /api routes only.

`OllamaRoute` is the route class of this package's router: it maps what a route raises (a body that does not
validate or is not JSON, Peregrine's typed errors, the engine's) to the envelope, with the status
`app/errors.classify` gives (400, 404, 503, ...), so the other API families keep their own envelopes. Errors after
a stream has started go out as one last `{"error": "..."}` line (`stream_errors`), as Ollama sends them. Bodies are
JSON whatever their Content-Type says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, _validation_message, classify
from app.limits import route_path
from engine.types import EngineError


class OllamaError(APIError):
    """An error worded for Ollama's clients (status from the subclass, as every APIError)."""


def message_of(exc: BaseException, request_id: str | None = None) -> tuple[int, str]:
    """(status, message) for any exception, by the one table in app/errors.py."""
    if isinstance(exc, RequestValidationError | ValidationError):
        message, _ = _validation_message(exc.errors())
        return 400, message
    if isinstance(exc, HTTPException):
        return exc.status_code, str(exc.detail)
    status, body = classify(exc, request_id)
    return status, body["error"]["message"]


def envelope(exc: BaseException, request: Request) -> JSONResponse:
    status, message = message_of(exc, getattr(request.state, "request_id", None))
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class OllamaRoute(APIRoute):
    """Answers this router's errors in Ollama's envelope (FastAPI's handlers are app-wide, so it is done here)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(_as_json(request))
            except (RequestValidationError, ValidationError, HTTPException, APIError, EngineError) as exc:
                return envelope(exc, request)

        return route


def _as_json(request: Request) -> Request:
    """The request with its Content-Type dropped, so the body is read as JSON whatever it says: Ollama's own
    examples post JSON with `curl -d`, which labels it a form."""
    scope = dict(request.scope)
    scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
    return Request(scope, request.receive)


async def stream_errors(events: AsyncIterator[dict[str, Any]], request_id: str | None) -> AsyncIterator[dict]:
    """The events, then `{"error": "..."}` as the last line if they fail once the answer has started."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is gone; the client must still hear why
        yield {"error": message_of(exc, request_id)[1]}
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class OllamaEnvelopeMiddleware:
    """Rewrites the OpenAI envelope the app's middlewares answer with before any route runs (app/limits.py: 401,
    413, 429, 503 while draining, a body that is not JSON) into Ollama's, for /api paths only."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith("/api/"):
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        body = b""

        async def rewrite(message: Message) -> None:
            nonlocal held, body
            if message["type"] == "http.response.start" and message["status"] >= 400 and _is_json(message):
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                payload = _flatten(body)
                headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
                await send({**held, "headers": [*headers, (b"content-length", str(len(payload)).encode())]})
                await send({"type": "http.response.body", "body": payload})

        await self.app(scope, receive, rewrite)


def _is_json(message: Message) -> bool:
    return any(k.lower() == b"content-type" and b"json" in v for k, v in message.get("headers", []))


def _flatten(body: bytes) -> bytes:
    """`{"error": {"message": ...}}` -> `{"error": "..."}`; anything else as it was."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return json.dumps({"error": error["message"]}).encode()
    return body


def install_envelope(app: Any) -> None:
    """Ollama's envelope for what the app's middlewares refuse on /api paths (call after install_hardening)."""
    app.add_middleware(OllamaEnvelopeMiddleware)
