"""Start serving: the HTTP server and the embedding model both starts share, and the several-models start
(`--model` more than once, or `--models-file`), which main.py hands over to `serve_models`.

Each of several models goes through the same acquisition as a single one (`models.acquire.acquire`: source,
device, dtype, preflight, download), then becomes a `serving.registry.ModelSpec` with its memory need by the one
memory arithmetic (models/memory.py: weights in the serving dtype + its KV cache + the packed copy where AMX
decode keeps one). The KV cache of each model is sized explicitly, never as a share of free memory (which the
first model would take whole): `kv_cache_bytes` of the model, else the server's `--kv-cache-bytes`, else one
sequence of the full context.

The registry loads the first model at start and the others when a request names them; `--models-memory-budget`
(default: 90% of the memory free at start) decides which idle models make room.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

from config import ConfigError, Settings
from config.models_file import ModelEntry, model_entries
from models.acquire import Prepared, StartError, acquire, counted_dtype, import_libraries, local_footprint

log = logging.getLogger("peregrine")

DEFAULT_BUDGET_SHARE = 0.9


def http_server(settings: Settings, app: Any) -> Any:
    """uvicorn for `app`, draining on SIGTERM (app/hardening.py)."""
    import uvicorn

    from app.hardening import DrainingServer

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, root_path=settings.root_path,
        timeout_keep_alive=settings.keep_alive, log_config=None, log_level=settings.log_level,
    )  # fmt: skip
    return DrainingServer(config, app, settings.shutdown_timeout)


def load_embedder(app: Any, embedder_at: tuple[Path, str] | None, device: str) -> None:
    """Attach the embedding model to the app (blocking); nothing when --embedding-model none."""
    if embedder_at is None:
        return
    from models.embedder import Embedder

    path, name = embedder_at
    app.state.embedder = Embedder.from_path(path, device=device, dtype="float32", name=name)
    log.info("embedding model %s loaded from %s", name, path)


# --- several models -------------------------------------------------------------------------------------


def serve_models(settings: Settings) -> int:
    """uvicorn with a model registry: the first model loads at start, the others on demand."""
    from app import create_app
    from models.memory import fmt_bytes
    from serving.registry import ModelRegistry, install_registry

    specs, first = prepare_models(settings)
    import_libraries()  # before the default model's and the embedding model's loader threads start
    app = create_app(engine=None, settings=settings)
    budget = memory_budget(settings, first.device)
    registry = ModelRegistry(
        specs, start_engine, budget, keep_alive_s=settings.model_keep_alive_s,
        load_wait_s=settings.model_load_wait, max_loaded=settings.max_loaded_models,
    )  # fmt: skip
    install_registry(app, registry)
    for spec in specs:
        log.info("model %s: needs %s (%s)", spec.name, fmt_bytes(spec.need_bytes), spec.need_words)
    log.info("serving %d models (default %s) within a memory budget of %s; keep-alive %s",
             len(specs), specs[0].name, fmt_bytes(budget), settings.model_keep_alive)  # fmt: skip
    threading.Thread(target=_load_embedder, args=(app, first.embedder_at, first.device), name="peregrine-embedder",
                     daemon=True).start()  # fmt: skip
    http_server(settings, app).run()
    return 0


def prepare_models(settings: Settings) -> tuple[list[Any], Prepared]:
    """Every model's spec, and the first model's acquisition (its device and the embedding model's location)."""
    if settings.use_ray:
        raise StartError("--ray-replicas / --ray-autoscale serve one model; drop them to serve several")
    try:
        entries = model_entries(settings)
    except ConfigError as exc:
        raise StartError(str(exc)) from None
    prepared = [acquire(entry.settings) for entry in entries]
    return [model_spec(entry, p) for entry, p in zip(entries, prepared, strict=True)], prepared[0]


def model_spec(entry: ModelEntry, prepared: Prepared) -> Any:
    """The registry's view of one model: its engine config with an explicit KV cache, and its memory need."""
    from models import memory, preflight
    from serving.registry import ModelSpec

    settings = entry.settings
    footprint = local_footprint(prepared, settings.model)
    size = memory.serving_size(
        footprint, counted_dtype(prepared), kv_dtype=settings.kv_cache_dtype, max_model_len=settings.max_model_len,
        kv_cache_bytes=settings.kv_cache_bytes,
        packed_copy=preflight.packed_copy_kept(prepared.device, settings.cpu_kernels, settings.cpu_isa),
    )  # fmt: skip
    return ModelSpec(
        name=entry.name, config=dataclasses.replace(prepared.engine_config, kv_cache_bytes=size.kv_cache_bytes),
        need_bytes=size.need_bytes, need_words=size.need_words, aliases=(settings.model,),
        keep_alive_s=entry.keep_alive_s, max_model_len=settings.max_model_len or footprint.context_len,
    )  # fmt: skip


def memory_budget(settings: Settings, device: str) -> int:
    """--models-memory-budget, else 90% of the RAM (or the CUDA device's VRAM) free now."""
    if settings.models_memory_budget is not None:
        return int(settings.models_memory_budget)
    from engine.backends.devices import cuda_index
    from models import preflight

    resources = preflight.measure_resources([], cuda_index(device))
    free = resources.vram_free if resources.vram_free is not None else resources.ram_free
    return int(free * DEFAULT_BUDGET_SHARE)


def start_engine(cfg: Any) -> Any:
    """Load one model and start its engine loop (blocking: the registry runs it in a worker thread)."""
    from models.engine_factory import build_async_engine, freeze_heap

    engine = build_async_engine(cfg)
    freeze_heap()
    engine.start()
    stats = engine.stats()
    log.info("%s: max_model_len %d, KV cache %d tokens", engine.model_name, engine.max_model_len,
             stats.kv_total_tokens)  # fmt: skip
    return engine


def _load_embedder(app: Any, embedder_at: tuple[Path, str] | None, device: str) -> None:
    try:
        load_embedder(app, embedder_at, device)
    except Exception:
        log.exception("loading the embedding model failed; /v1/embeddings stays unavailable")
