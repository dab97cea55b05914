"""Stream writers: turn an async iterator of JSON-able events into a streaming HTTP response.

A `StreamFormat` is chosen per request and decides the framing:

- SSE (`text/event-stream`): each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`
  when `done_marker` is on. The OpenAI SDK and llama-stack-client >= 0.6.1 stop on `[DONE]`;
  llama-stack-client <= 0.6.0 crashes on it and the Llama Stack server never sends it, so routes serving
  those clients pick `SSE_NO_DONE`.
- NDJSON (`application/x-ndjson`): one JSON object per line, never a `[DONE]`.

An error raised by the event iterator after the response has started cannot change the status code any
more: it goes out as one last event `{"error": {...}}` (same body as `app/errors.py` gives non-stream
errors), followed by the end marker. When the client leaves, Starlette cancels the body iterator (uvicorn
speaks ASGI 2.3, so StreamingResponse watches for `http.disconnect`); the cancellation runs the event
generator's `finally`, which aborts its engine request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import StreamingResponse

from app.errors import classify

log = logging.getLogger("peregrine.app")


@dataclass(frozen=True, slots=True)
class StreamFormat:
    kind: Literal["sse", "ndjson"]
    done_marker: bool = False

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.kind == "sse" else "application/x-ndjson"

    def encode(self, event: Mapping[str, Any]) -> bytes:
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"data: {data}\n\n".encode() if self.kind == "sse" else f"{data}\n".encode()

    def end(self) -> bytes:
        return b"data: [DONE]\n\n" if self.kind == "sse" and self.done_marker else b""


SSE = StreamFormat("sse", done_marker=True)
"""What OpenAI clients expect."""
SSE_NO_DONE = StreamFormat("sse", done_marker=False)
"""Llama Stack's own framing (and what old llama-stack-clients survive)."""
NDJSON = StreamFormat("ndjson")

SSE_KEEPALIVE = b": ping\n\n"  # a comment line: every SSE client ignores it

DoneMarker = Literal["auto", "always", "never"]
LAST_CLIENT_WITHOUT_DONE = (0, 6, 0)  # llama-stack-client <= 0.6.0 raises JSONDecodeError on [DONE]
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def stream_format(request: Request, *, openai: bool) -> StreamFormat:
    """The framing of one streamed answer, decided per request (docs/llama-stack.md has the table).

    Framing: NDJSON if `?format=ndjson` or the `Accept` header names `application/x-ndjson`; else SSE
    (`?format=sse` forces SSE). `[DONE]` (SSE only), first rule that applies:
    1. per request: `?done=true|false` or header `X-Peregrine-Done: true|false`;
    2. the `stream_done_marker` setting, when "always" or "never";
    3. "auto" (default): OpenAI routes send it, except to llama-stack-client <= 0.6.0 (its requests carry
       `X-LlamaStack-Client-Version`); the legacy Llama Stack routes never send it (no client of that
       API expects it, and the 0.0.x-0.2.x clients crash on it).
    """
    query, headers = request.query_params, request.headers
    fmt = (query.get("format") or "").lower()
    if fmt == "ndjson" or (fmt != "sse" and "application/x-ndjson" in headers.get("accept", "").lower()):
        return NDJSON
    return SSE if _wants_done(request, openai) else SSE_NO_DONE


def _wants_done(request: Request, openai: bool) -> bool:
    asked = (request.query_params.get("done") or request.headers.get("x-peregrine-done") or "").lower()
    if asked in _TRUE | _FALSE:
        return asked in _TRUE
    setting: DoneMarker = getattr(request.app.state.settings, "stream_done_marker", "auto")
    if setting != "auto":
        return setting == "always"
    client = _version(request.headers.get("x-llamastack-client-version"))
    return openai and (client is None or client > LAST_CLIENT_WITHOUT_DONE)


def _version(text: str | None) -> tuple[int, ...] | None:
    """"0.6.0" -> (0, 6, 0); "0.6.1rc2" -> (0, 6, 1); unreadable -> None (treated as a current client)."""
    if not text:
        return None
    parts: list[int] = []
    for piece in text.strip().lstrip("v").split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


async def encode_stream(
    events: AsyncIterator[Mapping[str, Any]], fmt: StreamFormat, request_id: str | None = None
) -> AsyncIterator[bytes]:
    """Frame each event; turn a mid-stream failure into one error event; always close `events`."""
    try:
        async for event in events:
            yield fmt.encode(event)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is gone; the client must still hear why
        _, body = classify(exc, request_id)
        yield fmt.encode(body)
    finally:
        await _aclose(events)
    end = fmt.end()
    if end:
        yield end


async def _aclose(events: AsyncIterator[Any]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def stream_response(
    events: AsyncIterator[Mapping[str, Any]],
    fmt: StreamFormat,
    *,
    request_id: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> StreamingResponse:
    """The one way routes return a stream."""
    all_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
    body = encode_stream(events, fmt, request_id)
    return StreamingResponse(body, media_type=fmt.media_type, headers=all_headers)
