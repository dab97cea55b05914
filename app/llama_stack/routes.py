"""Llama Stack routes: the modern extras (inspect, providers) and the legacy native inference API.

Modern Llama Stack (client and server 0.3 and later) speaks the OpenAI routes (`app/openai/routes.py`,
`app/openai/embeddings.py`) plus the few routes here: `GET /v1/health`, `GET /v1/version`, `GET /v1/providers`,
`GET /v1/providers/{id}` and `GET /v1/inspect/routes`.

The legacy inference API (llama-stack-client 0.0.x to 0.2.x) lives under three prefixes, one per client
era; the same handlers serve all of them:

| era            | chat                              | completion                  | embeddings                  |
|----------------|-----------------------------------|-----------------------------|-----------------------------|
| <= 0.0.52      | `/inference/chat_completion`      | `/inference/completion`     | `/inference/embeddings`     |
| 0.0.53-0.0.63  | `/alpha/inference/chat-completion`| `/alpha/inference/completion`| `/alpha/inference/embeddings`|
| 0.1.0-0.2.x    | `/v1/inference/chat-completion`   | `/v1/inference/completion`  | `/v1/inference/embeddings`  |

plus `/v1/inference/batch-chat-completion` and `/v1/inference/batch-completion` (0.2.x). Chat stream
deltas are `{"type": "text", "text"}` under `/v1/inference/` and bare strings under the older prefixes,
as each era's client expects. Streams are SSE without `[DONE]` (what Llama Stack sent), or NDJSON when
asked for (see `app/streaming.py`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.chat import harmony
from app.chat.plan import RequestPlan, build_plan
from app.chat.prompts import completion_prompt_ids
from app.deps import Engine, engine_for, generates, tool_call_parser
from app.engine_client import generate
from app.errors import NotFoundError
from app.health import engine_state
from app.llama_stack import convert as conv
from app.llama_stack import tools as llama_stack_tools
from app.llama_stack.schemas import (
    BatchChatCompletionRequest,
    BatchCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
)
from app.openai.embeddings import get_embedder, run_embed
from app.streaming import stream_format, stream_response
from engine.types import RequestOutput

router = APIRouter(tags=["llama-stack"])
LEGACY_PREFIXES = ("/inference", "/alpha/inference", "/v1/inference")
PROVIDER = {
    "api": "inference",
    "provider_id": "peregrine",
    "provider_type": "remote::peregrine",
    "config": {},
}


# ---------------------------------------------------------------- modern extras


@router.get("/v1/health")
async def health(request: Request) -> Response:
    """Llama Stack's health check (`inspect.health`): `{"status": "OK"}` once the model serves, else
    `{"status": "Error"}` with 503."""
    ok = engine_state(request) == "ready"
    return _json({"status": "OK" if ok else "Error"}, 200 if ok else 503)


@router.get("/v1/version")
async def version(request: Request) -> dict[str, str]:
    """Llama Stack's version check (`inspect.version`): Peregrine's version."""
    return {"version": request.app.version}


@router.get("/v1/providers")
async def list_providers(request: Request) -> dict[str, list[dict[str, Any]]]:
    """The one inference provider this server is, in Llama Stack's `ProviderInfo` shape."""
    return {"data": [_provider(request)]}


@router.get("/v1/providers/{provider_id}")
async def get_provider(provider_id: str, request: Request) -> dict[str, Any]:
    if provider_id != PROVIDER["provider_id"]:
        raise NotFoundError(
            f"Provider '{provider_id}' not found.", param="provider_id", code="provider_not_found"
        )
    return _provider(request)


@router.get("/v1/inspect/routes")
async def list_routes(request: Request) -> dict[str, list[dict[str, Any]]]:
    """Every documented HTTP route of this server (those in /openapi.json), in Llama Stack's `RouteInfo` shape."""
    paths = request.app.openapi().get("paths", {})
    routes = [
        {"route": path, "method": method.upper(), "provider_types": [PROVIDER["provider_type"]]}
        for path, operations in paths.items()
        for method in operations
    ]
    return {"data": routes}


def _provider(request: Request) -> dict[str, Any]:
    ok = engine_state(request) == "ready"
    return PROVIDER | {"health": {"status": "OK" if ok else "Error"}}


def _json(body: dict[str, Any], status: int) -> Response:
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------- legacy inference


def _legacy(path: str):
    """Register a handler under every legacy prefix (the 0.0.x snake_case chat path included)."""

    def register(handler):
        if path != "embeddings":
            generates(handler)
        for prefix in LEGACY_PREFIXES:
            route = f"{prefix}/{path}"
            if prefix == "/inference" and path == "chat-completion":
                route = "/inference/chat_completion"
            router.add_api_route(
                route, handler, methods=["POST"], include_in_schema=prefix == "/v1/inference"
            )
        return handler

    return register


def _delta_style(request: Request) -> conv.DeltaStyle:
    """Typed deltas for the route 0.1.0+ clients call, bare strings for the 0.0.x ones."""
    return "typed" if request.scope["route"].path.startswith("/v1/") else "bare"


def _rid(kind: str) -> str:
    """A fresh engine request id (never the client's x-request-id: two requests may share that)."""
    return f"{kind}-{uuid.uuid4().hex}"


def _stream(request: Request, events) -> Response:
    """Legacy Llama Stack streams: SSE without `[DONE]` unless the request asks otherwise."""
    request_id = getattr(request.state, "request_id", None)
    return stream_response(events, stream_format(request, openai=False), request_id=request_id)


@_legacy("chat-completion")
async def chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    """Legacy Llama Stack chat completion: `completion_message`, or with `stream: true` one `start`,
    many `progress` and one `complete` event (SSE, or NDJSON with `Accept: application/x-ndjson`).

    `tools` / `tool_choice` / `tool_config` answer with `completion_message.tool_calls` (streams: `tool_call`
    deltas); `response_format` (`json_schema`, `grammar`) constrains the answer (see app/llama_stack/tools.py)."""
    engine, _ = await engine_for(request, body.model_name)
    plan = await build_plan(engine.tokenizer, conv.chat_plan(body), tool_call_parser(request))
    outputs = _channels(engine, generate(engine, plan.prompts, plan.params, _rid("chat"), prompt_param="messages"))
    want_logprobs = plan.params.logprobs is not None
    if body.stream:
        events = conv.chat_events(outputs, _delta_style(request), want_logprobs)
        if plan.parses_tools:
            events = llama_stack_tools.split_events(events, plan.tool_plan, _delta_style(request) == "typed")
        return _stream(request, events)
    folds = await conv.fold_outputs(outputs, 1, want_logprobs)
    return _chat_responses(plan, folds)[0]


def _channels(engine: Engine, outputs: AsyncIterator[tuple[int, RequestOutput]],
              ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """A harmony model's chat outputs (gpt-oss) as plain content: this API has no reasoning field."""
    return harmony.content_only(outputs) if harmony.is_harmony(getattr(engine.tokenizer, "chat_template", None)) \
        else outputs


def _chat_responses(plan: RequestPlan, folds: list[conv.Fold]) -> list[dict[str, Any]]:
    responses = [fold.chat_response() for fold in folds]
    if plan.parses_tools:
        responses = [llama_stack_tools.split_response(r, plan.tool_plan) for r in responses]
    return responses


@_legacy("completion")
async def completion(body: CompletionRequest, request: Request) -> Any:
    """Legacy Llama Stack text completion of `content`: `{"content", "stop_reason", "logprobs"}`, or with
    `stream: true` chunks of `{"delta", "stop_reason", "logprobs"}`."""
    engine, _ = await engine_for(request, body.model_name)
    text = conv.content_text(body.content, "content")
    prompts = completion_prompt_ids(engine.tokenizer, text, engine.vocab_size)
    plan = await build_plan(engine.tokenizer, conv.completion_plan(body, prompts))
    outputs = generate(engine, plan.prompts, plan.params, _rid("cmpl"), prompt_param="content")
    want_logprobs = plan.params.logprobs is not None
    if body.stream:
        events = conv.completion_events(outputs, want_logprobs)
        return _stream(request, events)
    folds = await conv.fold_outputs(outputs, 1, want_logprobs)
    return folds[0].completion_response()


@router.post("/v1/inference/batch-chat-completion")
@generates
async def batch_chat_completion(body: BatchChatCompletionRequest, request: Request) -> dict[str, Any]:
    """Several conversations in one request, run concurrently: `{"batch": [chat response, ...]}`."""
    engine, _ = await engine_for(request, body.model_name)
    plan = await build_plan(engine.tokenizer, conv.chat_plan(body), tool_call_parser(request))
    outputs = _channels(engine, generate(engine, plan.prompts, plan.params, _rid("chat"),
                                         prompt_param="messages_batch"))
    folds = await conv.fold_outputs(outputs, len(plan.prompts), plan.params.logprobs is not None)
    return {"batch": _chat_responses(plan, folds)}


@router.post("/v1/inference/batch-completion")
@generates
async def batch_completion(body: BatchCompletionRequest, request: Request) -> dict[str, Any]:
    """Several completions in one request, run concurrently: `{"batch": [completion response, ...]}`."""
    engine, _ = await engine_for(request, body.model_name)
    texts = [conv.content_text(c, f"content_batch[{i}]") for i, c in enumerate(body.content_batch)]
    prompts = [completion_prompt_ids(engine.tokenizer, t, engine.vocab_size)[0] for t in texts]
    plan = await build_plan(engine.tokenizer, conv.completion_plan(body, prompts))
    outputs = generate(engine, plan.prompts, plan.params, _rid("cmpl"), prompt_param="content_batch")
    folds = await conv.fold_outputs(outputs, len(prompts), plan.params.logprobs is not None)
    return {"batch": [fold.completion_response() for fold in folds]}


@_legacy("embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> dict[str, list[list[float]]]:
    """Legacy Llama Stack embeddings: `{"embeddings": [[...], ...]}`, one vector per item of `contents`.
    `output_dimension` truncates (and re-normalises); `text_truncation: "none"` refuses over-long texts."""
    embedder = get_embedder(request, body.model_name)
    texts = [conv.content_text(c, f"contents[{i}]") for i, c in enumerate(body.contents)]
    result = await run_embed(
        embedder, texts, body.output_dimension, strict_length=body.text_truncation == "none", param="contents"
    )
    return {"embeddings": result.vectors}

