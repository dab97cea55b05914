"""A request's hold on one model of several: what the routes need of the model registry, and nothing more.

With several models (`--model` given more than once) `app.state.models` is a `ModelRouter`, in practice
`serving.registry.ModelRegistry`. The app knows it only by this Protocol, so imports flow one way: `serving/`
builds on the app (its errors, the `Engine` seam, this middleware) and the app never imports `serving/`.

- `request_keep_alive` reads a request's `keep_alive` (Ollama's field: a duration, or seconds; negative: forever).
- `ModelRouter.acquire` gives the engine of a model and a lease on it; `ModelLeaseMiddleware` hands every
  lease a request took back (`release`) once its response is complete, streams included, so neither keep-alive
  nor eviction unloads a model mid-answer.
"""

from __future__ import annotations

from typing import Any, Protocol

from app.errors import BadRequestError
from config import parse_duration


class ModelRouter(Protocol):
    """The registry as a request sees it (serving/registry.py has the rules: load on demand, memory budget,
    keep-alive). `acquire` raises the app's typed errors: 404 for an unknown model, 503 with Retry-After while
    it loads, 500 when its load failed."""

    async def acquire(self, model: str | None, keep_alive_s: float | None = None) -> tuple[Any, Any]:
        """(engine, slot): the model's started engine and the slot to hand to `release` later."""
        ...

    def release(self, slot: Any) -> None: ...


def request_keep_alive(value: float | str | None) -> float | None:
    """A request's `keep_alive` in seconds (negative: forever), or None when it gave none; 400 if unreadable."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise BadRequestError(f"keep_alive {exc}, got {value!r}", param="keep_alive") from None


class ModelLeaseMiddleware:
    """Releases the model leases a request took (`request.state.model_leases`) once its response is complete,
    streams included, and whether it finished, failed or was cancelled."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[tuple[ModelRouter, Any]] = []
        scope.setdefault("state", {})["model_leases"] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for registry, slot in leases:
                registry.release(slot)
