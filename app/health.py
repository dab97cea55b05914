"""Liveness and readiness.

`GET /health` is liveness: it answers 200 as soon as the HTTP server is up, also while the model is still
loading (Llama Stack's `remote::vllm` provider and process supervisors probe it). It turns 503 only when
the engine exists but its loop has died, so a supervisor restarts the process.

`GET /ready` (alias `GET /health/ready`) is readiness: 503 until the engine is attached to the app and
its loop is running, then 200; 503 again once a shutdown drains the server (`app.state.draining`), if the
loop dies, or if it stalls (has work but finished no step within `engine_stall_timeout`). Load balancers
and the test fixtures wait on it.

`GET /health/engine` is the engine's load as JSON (running, waiting, KV blocks, steps, admission counters).

With several models (`app.state.models`, serving/registry.py) each answer adds `models`: per model its state
(loaded, loading, unloaded, unloading), and on `/health/engine` its memory need, keep-alive and engine load.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


DEFAULT_STALL_TIMEOUT_S = 120.0


def engine_state(request: Request) -> str:
    """One of "loading" (no engine yet), "ready", "dead" (the loop stopped), "draining" (shutting down),
    "stalled" (the engine has work but no step finished within `engine_stall_timeout` seconds)."""
    registry = getattr(request.app.state, "models", None)
    if registry is not None:
        return _models_state(request, registry)
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return "loading"
    stats = engine.stats()
    if not stats.alive:
        return "dead"
    if getattr(request.app.state, "draining", False):
        return "draining"
    return "stalled" if stats.last_step_age_s > _stall_timeout(request) else "ready"


def _models_state(request: Request, registry) -> str:
    """Several models (serving/registry.py): ready as soon as the registry is attached, since models load on
    demand; a loaded engine whose loop died is replaced by the next request for it, so that is not "dead"."""
    if getattr(request.app.state, "draining", False):
        return "draining"
    ages = [s.engine.stats().last_step_age_s for s in registry.loaded() if s.engine is not None]
    return "stalled" if any(age > _stall_timeout(request) for age in ages) else "ready"


def models_health(registry, with_stats: bool = False) -> dict:
    """Per model: its state and figures (`ModelRegistry.describe`), and with `with_stats` the engine's load."""
    out = {}
    for name, slot in registry.slots.items():
        info = registry.describe(slot)
        engine = slot.engine
        if with_stats and engine is not None:
            stats = engine.stats()
            info |= {field: getattr(stats, field) for field in stats.__dataclass_fields__}
            info["kv_usage"] = stats.kv_usage
        out[name] = info
    return out


def _stall_timeout(request: Request) -> float:
    settings = getattr(request.app.state, "settings", None)
    return float(getattr(settings, "engine_stall_timeout", None) or DEFAULT_STALL_TIMEOUT_S)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process is serving HTTP (also while loading); 503 if the engine died."""
    state = engine_state(request)
    body: dict = {"status": "ok" if state != "dead" else "dead", "engine": state}
    registry = getattr(request.app.state, "models", None)
    if registry is not None:
        body["models"] = {name: info["state"] for name, info in models_health(registry).items()}
    return JSONResponse(body, status_code=503 if state == "dead" else 200)


@router.get("/health/engine")
async def engine_health(request: Request) -> JSONResponse:
    """Engine load and the HTTP side's admission counters, as JSON (503 while loading, or if the loop died).

    `kv_used_blocks` and `running` + `waiting` return to 0 when no request is in flight: the soak tests
    read this to prove that aborted and disconnected requests leave nothing behind."""
    state = engine_state(request)
    body: dict = {"status": state}
    engine = getattr(request.app.state, "engine", None)
    if engine is not None:
        stats = engine.stats()
        body |= {name: getattr(stats, name) for name in stats.__dataclass_fields__}
        body["kv_usage"] = stats.kv_usage
    registry = getattr(request.app.state, "models", None)
    if registry is not None:
        body["models"] = models_health(registry, with_stats=True)
    admission = getattr(request.app.state, "admission", None)
    if admission is not None:
        body |= {
            "http_in_flight": admission.in_flight,
            "http_active": admission.active,
            "http_refused_total": admission.refused_total,
            "http_admission_limit": admission.limit,
        }
    body["draining"] = bool(getattr(request.app.state, "draining", False))
    return JSONResponse(body, status_code=503 if state in ("loading", "dead") else 200)


@router.get("/ready")
@router.get("/health/ready", include_in_schema=False)
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the model is loaded and the engine loop runs; 503 before, while draining, if the
    loop died, or if it is stalled (work waiting, no step finished within `engine_stall_timeout`)."""
    state = engine_state(request)
    body = {"status": state}
    registry = getattr(request.app.state, "models", None)
    if registry is not None:
        body["models"] = {name: info["state"] for name, info in models_health(registry).items()}
    elif state == "ready":
        engine = request.app.state.engine
        body |= {"model": engine.model_name, "device": engine.device, "dtype": engine.dtype,
                 "max_model_len": engine.max_model_len}  # dtype: the one served (auto's choice on the CPU)
    return JSONResponse(body, status_code=200 if state == "ready" else 503)
