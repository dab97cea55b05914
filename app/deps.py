"""What every router shares: the engine seam (`Engine`, the Protocol the app holds the engine by), finding
the engine for a request (`get_engine`, `check_model`, `engine_for`), and the request-scoped settings the
routes read. Routers import this module, never each other."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request

from app.errors import ServiceUnavailableError, model_not_found
from app.leases import ModelRouter, request_keep_alive
from engine.types import EngineStats, RequestOutput, SamplingParams

F = TypeVar("F", bound=Callable[..., Any])


class Engine(Protocol):
    """The engine as the app sees it: `engine.AsyncEngine`, or a test's fake. docs/architecture.md has the
    contract; the app never reaches past it."""

    tokenizer: Any  # a Hugging Face tokenizer: apply_chat_template, encode, decode

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...


def generates(endpoint: F) -> F:
    """Mark a route that runs the engine: the limits middleware admits, times and cancels these
    (app/limits.py), whatever path they are mounted at."""
    endpoint.generates = True  # type: ignore[attr-defined]
    return endpoint


def get_engine(request: Request) -> Engine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise ServiceUnavailableError("The model is still loading; retry when GET /ready answers 200.")
    return engine


def served_names(request: Request, engine: Engine) -> list[str]:
    """The served id first, then aliases a client may also use (the model path or name it was started with)."""
    settings = request.app.state.settings
    names = [engine.model_name]
    for alias in (getattr(settings, "served_model_name", None), getattr(settings, "model", None)):
        if alias and str(alias) not in names:
            names.append(str(alias))
    return names


def check_model(request: Request, engine: Engine, model: str | None) -> str:
    """Accept the served id or an alias; answer with the served id. 404 for anything else."""
    if model is None or model in served_names(request, engine):
        return engine.model_name
    raise model_not_found(model, [engine.model_name])


async def engine_for(
    request: Request, model: str | None, keep_alive: float | str | None = None
) -> tuple[Engine, str]:
    """The engine serving the request's `model` and the id to answer with. One model: `app.state.engine`.
    Several (`app.state.models`, serving/registry.py): the registry's, loaded on demand, leased until the
    response is complete; `keep_alive` (Ollama's) sets how long it stays loaded after this request."""
    registry: ModelRouter | None = getattr(request.app.state, "models", None)
    if registry is None:
        engine = get_engine(request)
        return engine, check_model(request, engine, model)
    engine, slot = await registry.acquire(model, request_keep_alive(keep_alive))
    request.state.model_leases.append((registry, slot))
    return engine, slot.spec.name


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


def reasoning_parser(request: Request) -> str:
    return getattr(request.app.state.settings, "reasoning_parser", "auto")


def generation_defaults(request: Request) -> dict[str, float]:
    """The server's default sampling for keys a request leaves out (`--override-generation-config`)."""
    return getattr(request.app.state.settings, "override_generation_config", {})


def tool_call_parser(request: Request) -> str:
    return getattr(request.app.state.settings, "tool_call_parser", "auto")
