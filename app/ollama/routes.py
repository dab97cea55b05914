"""Ollama's API under /api: what the `ollama` clients, Open WebUI and Llama Stack's `remote::ollama` call.

Thin routes: the request goes through `convert.to_chat_request` into the shared chat pipeline (`pipeline.py`), and
the pipeline's chunks come back as Ollama's lines (`convert.Turn`). Streams are NDJSON (one JSON object a line, the
last with `done: true`), on by default as in Ollama. Errors are Ollama's `{"error": "..."}` (`errors.py`).

`keep_alive` ("5m", seconds, 0, negative: forever) sets how long the model stays loaded after the request, through
the several-models registry (serving/registry.py); an empty chat or prompt only loads the model, and with
`keep_alive: 0` unloads it. With one model served it is accepted and the model stays loaded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.deps import generates, request_id, request_keep_alive  # re-exported there on every branch
from app.errors import BadRequestError, NotFoundError, model_not_found
from app.ollama import catalog, pull
from app.ollama import convert as conv
from app.ollama import pipeline as shared
from app.ollama.errors import OllamaRoute, install_envelope, stream_errors
from app.ollama.schemas import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    GenerationRequest,
    ModelRequest,
    PullRequest,
)
from app.streaming import NDJSON, stream_response
from app.ui import chat_page

router = APIRouter(prefix="/api", tags=["ollama"], route_class=OllamaRoute)
root_router = APIRouter(tags=["ollama"], route_class=OllamaRoute)
__all__ = ["install_envelope", "root_router", "router"]
VERSION = "0.12.0"  # the Ollama API this follows; clients such as Open WebUI read it
LIVENESS = "Ollama is running"


@root_router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root(request: Request) -> Response:
    """Ollama's liveness for its clients (plain text); browsers (`text/html` in Accept) get the chat page."""
    if "text/html" in request.headers.get("accept", "").lower():
        return await chat_page(request)
    return PlainTextResponse(LIVENESS)


@router.get("/version")
async def version() -> dict[str, str]:
    """The Ollama API version this server follows."""
    return {"version": VERSION}


@router.get("/tags")
async def tags(request: Request) -> dict[str, Any]:
    """The served models (every one, loaded or not), and the embedding model, with sizes and details."""
    embedder = getattr(request.app.state, "embedder", None)
    entries = [catalog.tag_entry(m) for m in catalog.served(request)]
    return {"models": entries + ([catalog.embedder_entry(embedder)] if embedder is not None else [])}


@router.get("/ps")
async def ps(request: Request) -> dict[str, Any]:
    """The loaded models, with their memory and when keep-alive unloads them (Llama Stack's health check)."""
    return {"models": [catalog.ps_entry(m) for m in catalog.served(request) if m.engine is not None]}


@router.post("/show")
async def show(body: ModelRequest, request: Request) -> dict[str, Any]:
    """A model's chat template (Jinja), parameters, details and `model_info` (architecture, context length)."""
    model = _served(request, body.target)
    return catalog.show(model, getattr(model.engine, "tokenizer", None))


def _served(request: Request, name: str | None) -> catalog.Served:
    models = catalog.served(request)
    wanted = pull.hub_name(name or "")
    for model in models:
        if wanted in (model.name, *_aliases(request, model)):
            return model
    raise model_not_found(name or "", [m.name for m in models])


def _aliases(request: Request, model: catalog.Served) -> list[str]:
    registry = getattr(request.app.state, "models", None)
    if registry is not None:
        return list(registry.slots[model.name].spec.aliases)
    settings = request.app.state.settings
    return [str(a) for a in (getattr(settings, "served_model_name", None), getattr(settings, "model", None)) if a]


@router.post("/chat")
@generates
async def chat(body: ChatRequest, request: Request) -> Response:
    """Chat (Ollama `POST /api/chat`): `messages` (with `tool_calls` and `tool` results), `tools`, `format`,
    `options`, `think`, `keep_alive`, `stream` (default true). Images are refused (text-only models)."""
    started = time.perf_counter_ns()
    messages = conv.chat_messages(body.messages or [])
    if not messages:
        return await _load_only(body, request, started, "chat")
    return await _answer(body, request, started, "chat", conv.to_chat_request(body, messages))


@router.post("/generate")
@generates
async def generate(body: GenerateRequest, request: Request) -> Response:
    """Generate (Ollama `POST /api/generate`): `prompt` through the chat template (with `system`), or as it is
    with `raw: true` (after `context` ids, if given); `format`, `options`, `think`, `keep_alive`, `stream`."""
    started = time.perf_counter_ns()
    if body.template:
        raise BadRequestError("template: Go templates are not supported; Peregrine renders prompts with the "
                              "model's own chat template. Send raw: true with a prompt you formatted.", param="template")
    if body.suffix:
        raise BadRequestError("suffix: fill-in-the-middle is not supported.", param="suffix")
    if body.context and not body.raw:
        raise BadRequestError("context: only with raw: true (the ids are prepended to the raw prompt).",
                              param="context")
    if not body.prompt and not body.context:
        conv.no_images(body.images, "images")
        return await _load_only(body, request, started, "generate")
    return await _answer(body, request, started, "generate", conv.to_chat_request(body, conv.generate_messages(body)))


async def _answer(body: GenerationRequest, request: Request, started: int, kind: conv.Kind, wire: Any) -> Response:
    request_keep_alive(body.keep_alive)  # a 400 when unreadable, with one model served too
    engine, model = await shared.engine_for(request, body.model, body.keep_alive)
    turn = conv.Turn(kind, model, started, time.perf_counter_ns() - started)
    raw = isinstance(body, GenerateRequest) and body.raw
    ids = shared.raw_prompt_ids(engine, body.prompt or "", body.context) if raw else None
    chunks = await shared.chat_events(request, engine, model, wire, ids, "prompt" if kind == "generate" else "messages")
    if body.stream:
        lines = stream_errors(_lines(chunks, turn), request_id(request))
        return stream_response(lines, NDJSON, request_id=request_id(request))
    async for chunk in chunks:
        turn.feed(chunk)
    return JSONResponse(turn.whole())


async def _lines(chunks: AsyncIterator[dict[str, Any]], turn: conv.Turn) -> AsyncIterator[dict[str, Any]]:
    async for chunk in chunks:
        line = turn.feed(chunk)
        if line is not None:
            yield line
    calls = turn.tool_call_line()
    if calls is not None:
        yield calls
    yield turn.last_line()


async def _load_only(body: GenerationRequest, request: Request, started: int, kind: conv.Kind) -> Response:
    """Ollama's empty request: load the model (or, with `keep_alive: 0`, unload it) and answer `done`."""
    keep_alive = request_keep_alive(body.keep_alive)
    registry = getattr(request.app.state, "models", None)
    if keep_alive == 0 and registry is not None:
        slot = registry.slot(body.model)
        if slot.engine is not None and not slot.busy:
            await registry.unload(slot.spec.name)
        else:
            slot.keep_alive_s = 0.0  # busy or loading: keep-alive unloads it once its requests are done
        line, reason = conv.Turn(kind, slot.spec.name, started, 0), "unload"
    else:
        _, model = await shared.engine_for(request, body.model, body.keep_alive)
        line, reason = conv.Turn(kind, model, started, time.perf_counter_ns() - started), "load"
    answer = {k: v for k, v in line.last_line().items() if not k.startswith(("prompt_", "eval_", "total_"))}
    answer["done_reason"] = reason
    if body.stream:
        return stream_response(_one(answer), NDJSON, request_id=request_id(request))
    return JSONResponse(answer)


async def _one(line: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield line


@router.post("/embed")
async def embed(body: EmbedRequest, request: Request) -> dict[str, Any]:
    """Embeddings (Ollama `POST /api/embed`): `input` a text or a list; `truncate` (default true) cuts texts
    longer than the model reads, false refuses them; `dimensions` keeps the first N components."""
    started = time.perf_counter_ns()
    embedder = shared.get_embedder(request, pull.hub_name(body.model))
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts:
        raise BadRequestError("input must not be empty.", param="input")
    result = await shared.embed(embedder, texts, body.dimensions, body.truncate)
    return {"model": embedder.name, "embeddings": result.vectors, "total_duration": time.perf_counter_ns() - started,
            "load_duration": 0, "prompt_eval_count": result.prompt_tokens}  # fmt: skip


@router.post("/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> dict[str, Any]:
    """The older embeddings route (Ollama `POST /api/embeddings`): one `prompt`, one `embedding`."""
    embedder = shared.get_embedder(request, pull.hub_name(body.model))
    result = await shared.embed(embedder, [body.prompt], None, True)
    return {"embedding": result.vectors[0]}


@router.post("/pull")
async def pull_model(body: PullRequest, request: Request) -> Response:
    """Download a model (Ollama `POST /api/pull`): a Hub id into the download dir, or a local folder or .gguf
    checked in place; the preflight refuses one that cannot fit. Streams progress lines, then `success`."""
    name = body.target
    if not name:
        raise BadRequestError("model is required.", param="model")
    events = pull.pull_events(name, request.app.state.settings)
    if body.stream:
        return stream_response(stream_errors(events, request_id(request)), NDJSON, request_id=request_id(request))
    lines = [line async for line in events]  # raises on failure: the error envelope with its status
    return JSONResponse(lines[-1])


@router.delete("/delete")
async def delete_model(body: ModelRequest, request: Request) -> Response:
    """Delete a model Peregrine downloaded from the Hub (Ollama `DELETE /api/delete`); never a bundled or local one."""
    if not body.target:
        raise BadRequestError("model is required.", param="model")
    await pull.delete(body.target, request.app.state.settings, [m.name for m in catalog.served(request)])
    return Response(status_code=200)


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"], include_in_schema=False)
async def unknown(path: str, request: Request) -> Response:
    """Routes of Ollama's API this server does not have (/api/create, /api/copy, /api/push, ...): 404, Ollama's way."""
    raise NotFoundError(f"{request.method} /api/{path} is not served here (Peregrine serves Ollama's inference and "
                        "model listing routes; docs/ollama.md has the list)")
