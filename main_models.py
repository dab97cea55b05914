"""Start Peregrine with several models (`--model` more than once, or `--models-file`): main.py's start, per model.

Each model goes through the same steps as a single one (`main.prepare`: source, device, dtype, preflight,
download), then becomes an `serving.registry.ModelSpec` with its memory need by the preflight arithmetic
(weights in the serving dtype + its KV cache + the packed copy where AMX decode keeps one). The KV cache of
each model is sized explicitly, never as a share of free memory (which the first model would take whole):
`kv_cache_bytes` of the model, else the server's `--kv-cache-bytes`, else one sequence of the full context.

The registry loads the first model at start and the others when a request names them; `--models-memory-budget`
(default: 90% of the memory free at start) decides which idle models make room.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from config import ConfigError, Settings
from config.models_file import ModelEntry, model_entries
from main import Prepared, StartError, engine_config, http_server, load_embedder, prepare

log = logging.getLogger("peregrine")

DEFAULT_BUDGET_SHARE = 0.9


def prepare_models(settings: Settings) -> tuple[list[Any], tuple[Path, str] | None, str]:
    """Every model's spec, the embedding model's location, and the first model's device."""
    if settings.use_ray:
        raise StartError("--ray-replicas / --ray-autoscale serve one model; drop them to serve several")
    try:
        entries = model_entries(settings)
    except ConfigError as exc:
        raise StartError(str(exc)) from None
    prepared = [prepare(entry.settings) for entry in entries]
    specs = [model_spec(entry, p) for entry, p in zip(entries, prepared, strict=True)]
    return specs, prepared[0].embedder_at, prepared[0].device


def model_spec(entry: ModelEntry, prepared: Prepared) -> Any:
    """The registry's view of one model: its engine config and its memory need, with the arithmetic."""
    from models import preflight
    from serving.registry import ModelSpec

    settings = entry.settings
    footprint = local_footprint(prepared.model_path, settings)
    kv_dtype = preflight.kv_cache_stored(prepared.dtype, settings.kv_cache_dtype)  # dtype auto may keep float32
    kv = int(settings.kv_cache_bytes or preflight.kv_cache_need(
        footprint, preflight.DTYPE_BYTES[kv_dtype], settings.max_model_len, None))  # fmt: skip
    settings = settings.model_copy(update={"kv_cache_bytes": kv})
    need, words = preflight.memory_need(
        footprint, prepared.dtype, max_model_len=settings.max_model_len, kv_cache_bytes=kv,
        packed_copy=preflight.packed_copy_kept(prepared.device, settings.cpu_kernels, settings.cpu_isa),
        kv_dtype=settings.kv_cache_dtype,
    )  # fmt: skip
    return ModelSpec(
        name=entry.name, config=engine_config(settings, prepared), need_bytes=need, need_words=words,
        aliases=(settings.model,), keep_alive_s=entry.keep_alive_s,
        max_model_len=settings.max_model_len or footprint.context_len,
    )  # fmt: skip


def local_footprint(path: Path, settings: Settings) -> Any:
    """What the (now local) model needs, from its headers: a .gguf file or a transformers folder."""
    from models import preflight

    try:
        if path.suffix == ".gguf":
            return preflight.gguf_footprint(path, cached=True)
        return preflight.folder_footprint(path)
    except (OSError, ValueError, KeyError) as exc:
        raise StartError(f"cannot read the size of {settings.model} at {path}: {exc}") from None


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
    from models.engine_factory import build_async_engine

    engine = build_async_engine(cfg)
    engine.start()
    stats = engine.stats()
    log.info("%s: max_model_len %d, KV cache %d tokens", engine.model_name, engine.max_model_len,
             stats.kv_total_tokens)  # fmt: skip
    return engine


def serve_models(settings: Settings, specs: list[Any], embedder_at: tuple[Path, str] | None, device: str) -> int:
    """uvicorn with a model registry: the first model loads at start, the others on demand."""
    from app import create_app
    from models.preflight import fmt_bytes
    from serving.registry import ModelRegistry, install_registry

    app = create_app(engine=None, settings=settings)
    budget = memory_budget(settings, device)
    registry = ModelRegistry(
        specs, start_engine, budget, keep_alive_s=settings.model_keep_alive_s,
        load_wait_s=settings.model_load_wait, max_loaded=settings.max_loaded_models,
    )  # fmt: skip
    install_registry(app, registry)
    for spec in specs:
        log.info("model %s: needs %s (%s)", spec.name, fmt_bytes(spec.need_bytes), spec.need_words)
    log.info("serving %d models (default %s) within a memory budget of %s; keep-alive %s",
             len(specs), specs[0].name, fmt_bytes(budget), settings.model_keep_alive)  # fmt: skip
    threading.Thread(target=_load_embedder, args=(app, embedder_at, device), name="peregrine-embedder",
                     daemon=True).start()  # fmt: skip
    http_server(settings, app).run()
    return 0


def _load_embedder(app: Any, embedder_at: tuple[Path, str] | None, device: str) -> None:
    try:
        load_embedder(app, embedder_at, device)
    except Exception:
        log.exception("loading the embedding model failed; /v1/embeddings stays unavailable")
