"""`create_app`: the FastAPI application, its routers, error handlers and request ids.

The app can exist before the engine does: `create_app(engine=None, settings)` serves `/health` (200)
and readiness (503) while the model loads; `app.state.engine = engine` switches the model routes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import health
from app.anthropic import errors as anthropic_errors
from app.anthropic import routes as anthropic
from app.deps import Engine
from app.errors import classify, install_error_handlers
from app.hardening import install_hardening
from app.leases import ModelLeaseMiddleware
from app.limits import generation_paths
from app.llama_stack import routes as llama_stack
from app.metrics import install_metrics
from app.ollama import routes as ollama
from app.openai import embeddings, stored
from app.openai import routes as openai_routes
from app.openai import tokenize as tokenize_routes
from app.openapi import install_openapi
from app.responses import routes as responses_routes
from app.ui import install_ui

log = logging.getLogger("peregrine.app")
REQUEST_ID_HEADER = "x-request-id"
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")  # a client's id is echoed only if it is this tame


def create_app(engine: Engine | None = None, settings: Any = None, embedder: Any = None) -> FastAPI:
    """Build the HTTP app around an engine (or None while it loads) and the Settings object."""
    app = FastAPI(
        title="Peregrine",
        version="0.1.0",
        description="A self-hosted LLM inference server speaking the OpenAI and Llama Stack APIs.",
        strict_content_type=False,  # a JSON body without a Content-Type header is still read as JSON
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.embedder = embedder
    install_error_handlers(app)
    install_openapi(app)  # /docs shows the 400 envelope Peregrine sends, not FastAPI's unused 422
    routers = [health.router, openai_routes.router, embeddings.router, llama_stack.router, tokenize_routes.router,
               responses_routes.router, stored.router, ollama.router, ollama.root_router, anthropic.router]
    for router in routers:
        app.include_router(router)
    install_ui(app)  # GET / (the chat page) and /ui/ (its static files)
    app.add_middleware(ModelLeaseMiddleware)  # several models: leases end when the response is complete
    generation = generation_paths(route for router in routers for route in router.routes)
    install_hardening(app, settings, generation)  # auth, limits, draining, disconnect/timeout cancellation
    ollama.install_envelope(app)  # /api paths: those refusals in Ollama's envelope
    install_metrics(app)  # GET /metrics; its middleware sits outside hardening, so 401/429 are counted
    app.add_middleware(RequestIdMiddleware)  # outermost but one, so every answer carries the id
    app.add_middleware(anthropic_errors.AnthropicErrors)  # Anthropic's envelope on its routes, whoever raised
    _build_openapi_at_start(app)
    return app


def _build_openapi_at_start(app: FastAPI) -> None:
    """Build the OpenAPI schema (what /docs serves and the metrics middleware reads its route labels from) when the
    server starts, not during the first request (~0.15 s of it, on a 2-core AMD EPYC)."""
    outer = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(asgi_app: Any) -> AsyncIterator[Any]:
        app.openapi()
        async with outer(asgi_app) as state:
            yield state

    app.router.lifespan_context = lifespan


class RequestIdMiddleware:
    """Give every request an id (the client's `x-request-id` if sane, else a fresh one), put it in
    `request.state.request_id`, echo it in the response header, and turn an unhandled exception into the
    500 envelope that names it (logged with the traceback), as long as the response has not started."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            status, body = classify(exc, request_id)
            await _send_json(send_with_id, status, body)


def _incoming_id(scope: Scope) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"x-request-id":
            text = value.decode("latin-1")
            return text if _CLIENT_ID.match(text) else None
    return None


async def _send_json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
