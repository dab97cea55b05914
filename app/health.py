"""Liveness and readiness.

`GET /health` is liveness: it answers 200 as soon as the HTTP server is up, also while the model is still
loading (Llama Stack's `remote::vllm` provider and process supervisors probe it). It turns 503 only when
the engine exists but its loop has died, so a supervisor restarts the process.

`GET /ready` (alias `GET /health/ready`) is readiness: 503 until the engine is attached to the app and
its loop is running, then 200; 503 again once a shutdown drains the server (`app.state.draining`).
Load balancers and the test fixtures wait on it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


def engine_state(request: Request) -> str:
    """One of "loading" (no engine yet), "ready", "dead" (the loop stopped), "draining" (shutting down)."""
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return "loading"
    if not engine.stats().alive:
        return "dead"
    return "draining" if getattr(request.app.state, "draining", False) else "ready"


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process is serving HTTP (also while loading); 503 if the engine died."""
    state = engine_state(request)
    return JSONResponse({"status": "ok" if state != "dead" else "dead", "engine": state},
                        status_code=503 if state == "dead" else 200)  # fmt: skip


@router.get("/ready")
@router.get("/health/ready", include_in_schema=False)
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the model is loaded and the engine loop runs; 503 before (and if it died)."""
    state = engine_state(request)
    body = {"status": state}
    if state == "ready":
        engine = request.app.state.engine
        body |= {"model": engine.model_name, "device": engine.device, "max_model_len": engine.max_model_len}
    return JSONResponse(body, status_code=200 if state == "ready" else 503)
