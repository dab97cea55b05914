"""Anthropic's error envelope on the Messages routes, whoever raised the error.

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}, "request_id": "..."}

The shared layers (validation, auth, limits, body size, model lookup, the 500 handler) answer in OpenAI's
envelope; `AnthropicErrors`, the outermost middleware, rewrites any JSON error answer on these routes into
Anthropic's, with the error type Anthropic uses for its status. Status codes are kept as they are. A stream the
limits middleware cuts (request_timeout) gets its last event as Anthropic's `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATHS = ("/v1/messages",)  # and what lies under it: /v1/messages/count_tokens
BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip
_BY_OPENAI_TYPE = {  # errors inside a stream carry no status: map the shared layers' `type` instead
    "authentication_error": "authentication_error", "permission_error": "permission_error",
    "not_found_error": "not_found_error", "rate_limit_error": "rate_limit_error",
    "service_unavailable": "overloaded_error", "timeout_error": "timeout_error",
    "internal_server_error": "api_error", "request_too_large": "request_too_large",
}  # fmt: skip


def envelope(error_type: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    return body | ({"request_id": request_id} if request_id else {})


def type_of_status(status: int) -> str:
    return BY_STATUS.get(status, "invalid_request_error" if status < 500 else "api_error")


def type_of_openai_error(openai_type: str) -> str:
    return _BY_OPENAI_TYPE.get(openai_type, "invalid_request_error")


def translate(status: int, body: bytes, request_id: str | None) -> bytes:
    """An OpenAI-envelope error body -> Anthropic's; anything else is left alone."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body
    if not isinstance(error, dict):
        return body
    message = str(error.get("message") or "Request failed.")
    param = error.get("param")
    if param and status == 400 and str(param) not in message:
        message = f"{param}: {message}"
    return json.dumps(envelope(type_of_status(status), message, request_id)).encode()


def _ours(scope: Scope) -> bool:
    path = scope.get("path", "")
    return scope["type"] == "http" and any(path == p or path.startswith(p + "/") for p in PATHS)


class AnthropicErrors:
    """Rewrite JSON error answers on the Messages routes into Anthropic's envelope (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _ours(scope):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 and _is_json(message):
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(_stream_error(message))
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_translated(send, start, b"".join(chunks))

        await self.app(scope, receive, rewrite)


def _stream_error(message: Message) -> Message:
    """A stream cut by the limits middleware (request_timeout) ends with the shared error event, unnamed:
    Anthropic's clients dispatch on the event name, so it goes out as an `error` event."""
    body = message.get("body", b"") if message["type"] == "http.response.body" else b""
    if not body.startswith(b'data: {"error"'):
        return message
    try:
        error = json.loads(body[len(b"data: "):])["error"]
    except (ValueError, KeyError, TypeError):
        return message
    event = envelope(type_of_openai_error(str(error.get("type"))), str(error.get("message")))
    return {**message, "body": f"event: error\ndata: {json.dumps(event)}\n\n".encode()}


def _is_json(message: Message) -> bool:
    return any(k.lower() == b"content-type" and b"json" in v for k, v in message.get("headers", []))


async def _send_translated(send: Send, start: Message, body: bytes) -> None:
    headers = dict((k.lower(), v) for k, v in start.get("headers", []))
    request_id = headers.get(b"x-request-id", b"").decode("latin-1") or None
    body = translate(start["status"], body, request_id)
    kept = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    if request_id:
        kept.append((b"request-id", request_id.encode("latin-1")))
    await send({**start, "headers": [*kept, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
