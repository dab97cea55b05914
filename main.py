"""Start Peregrine: settings -> preflight -> download -> app -> uvicorn, with the engine loading behind it.

    python main.py --help                     # every flag, with its default and environment variable
    python main.py                            # the bundled SmolLM2-135M-Instruct on 127.0.0.1:8000
    python main.py --model Qwen/Qwen2.5-7B-Instruct --device cuda --dtype bfloat16

The HTTP server starts before the model is loaded: `/health` answers at once and readiness
(`/health/ready`) is 503 until the engine runs. Nothing heavy (torch, transformers) is imported before
the flags are parsed, so `--help` and a bad flag answer fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config import Settings, load_settings, settings_or_exit

log = logging.getLogger("peregrine")


@dataclass(frozen=True)
class Prepared:
    """The outcome of the steps before serving: local files, and the device and dtype chosen for them."""

    model_path: Path  # a folder, or a .gguf file
    device: str  # "cpu", "cuda:0", "tt"
    dtype: str  # "float32", "bfloat16", "float16"; "auto" on the CPU, chosen by the loader (models/autotune/dtype.py)
    embedder_at: tuple[Path, str] | None = None  # the embedding model's folder and served name


class StartError(RuntimeError):
    """A start-up step failed in a way the user can fix; the message says how."""


def main(argv: list[str] | None = None) -> int:
    settings = settings_or_exit(argv)
    configure_logging(settings.log_level)
    quiet_openmp_waits()
    apply_cpu_isa(settings.cpu_isa)
    try:
        if settings.multi_model:
            from main_models import prepare_models, serve_models

            return serve_models(settings, *prepare_models(settings))
        prepared = prepare(settings)
    except StartError as exc:
        log.error("%s", exc)
        return 1
    return (serve_on_ray if settings.use_ray else serve)(settings, prepared)


# libgomp's spins before an idle OpenMP worker sleeps (its default is 300,000, "about 3 ms"; PASSIVE alone is 0).
OPENMP_SPINS = "1000"


def quiet_openmp_waits() -> None:
    """OpenMP workers spin briefly, then sleep, unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT. The engine
    runs in its own thread next to the event loop; libgomp's default spin of milliseconds took the cores that
    thread and other processes needed (5-10x slower decoding under CPU contention), so the policy is PASSIVE.
    Sleeping at once, though, makes every one of a prefill's ~450 torch ops wake the worker from sleep (on a
    2-vCPU KVM guest that cost a 128-token prompt's TTFT about 40 ms), so the workers first spin GOMP_SPINCOUNT =
    OPENMP_SPINS times, across the gaps between ops (docs/benchmarks.md, "OpenMP spin-waiting"). Called on
    start, before anything imports torch."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINS


def apply_cpu_isa(cap: str) -> None:
    """Log the instruction set --cpu-isa leaves the kernels (the cap itself travels in EngineConfig.cpu_isa)."""
    from engine.backends import cpu_features

    detected = cpu_features.detected_level()
    log.info("CPU kernels' instruction set: %s (this CPU: %s%s)", cpu_features.isa_level(cap=cap), detected,
             "" if cap == "auto" else f", capped by --cpu-isa {cap}")  # fmt: skip


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", stream=sys.stderr
    )


# --- before serving: device, dtype, preflight, download -------------------------------------------------


def prepare(settings: Settings) -> Prepared:
    """Resolve the model source, device and dtype; refuse early if it will not fit; download if needed."""
    from engine.backends.devices import DeviceError, resolve
    from models.hub import HubError, download, plan_download, resolve_source

    try:
        source = resolve_source(settings.model, settings.revision)
        resolved = resolve(settings.device, settings.dtype)  # the one resolution: EngineConfig carries it
        device, dtype = resolved.device, resolved.dtype
        plan = plan_download(source, **_hub_args(settings)) if source.kind == "hub" else None
        log.info("model %s (%s), device %s, dtype %s, KV cache budget %s", settings.model, source.label, device,
                 "auto (decode steps timed once loaded)" if dtype == "auto" else dtype,
                 kv_budget_text(settings))  # fmt: skip
        if not settings.skip_preflight:
            run_preflight(settings, source, plan, device, dtype)
        path = download(plan, **_hub_args(settings, plan=False)) if plan else source.path
    except (DeviceError, HubError) as exc:
        raise StartError(str(exc)) from None
    return Prepared(Path(str(path)), device, dtype, embedder_location(settings))


def kv_budget_text(settings: Settings) -> str:
    if settings.kv_cache_bytes is not None:
        return f"{settings.kv_cache_bytes.human_readable()} (--kv-cache-bytes)"
    return f"{settings.kv_cache_memory_fraction:.0%} of the memory free after loading"


def _hub_args(settings: Settings, plan: bool = True) -> dict[str, Any]:
    args: dict[str, Any] = {"token": settings.hf_token_value, "download_dir": settings.download_dir}
    return args | ({"trust_remote_code": settings.trust_remote_code} if plan else {})


def run_preflight(settings: Settings, source: Any, plan: Any, device: str, dtype: str) -> None:
    """Disk for the download (and a GGUF conversion), RAM or VRAM for weights + minimal KV cache."""
    from engine.backends.devices import cuda_index
    from models import preflight
    from models.hub import default_download_dir, fetch_config
    from models.loader import gguf_cache_folder, is_converted

    download_dir = settings.download_dir or default_download_dir()
    dense: tuple[str, ...] = ()
    try:
        if source.kind == "gguf":
            quantized = settings.weight_format != "dense" and device == "cpu"  # kept as the file holds them
            cached = quantized or is_converted(gguf_cache_folder(source.path, settings.cache_dir))
            footprint = preflight.gguf_footprint(source.path, cached=cached, quantized=quantized)
            if quantized and settings.weight_format == "auto":  # dense copies timed beside it, where they fit
                dense = ("float32", "bfloat16") if dtype == "auto" else (dtype,)
        elif source.kind == "folder":
            footprint = preflight.folder_footprint(source.path)
        else:
            config = fetch_config(plan, **_hub_args(settings, plan=False))
            footprint = preflight.hub_footprint(plan.param_count, plan.files, plan.missing_bytes, config)
    except (OSError, ValueError, KeyError) as exc:
        raise StartError(
            f"preflight cannot read {source.label}: {exc} (--skip-preflight skips the check)"
        ) from None
    gpu = cuda_index(device)
    resources = preflight.measure_resources([download_dir, settings.cache_dir], gpu)
    needs = preflight.check(
        footprint, resources, dtype=dtype, on_cuda=gpu is not None, device_label=device,
        download_dir=str(download_dir), cache_dir=str(settings.cache_dir),
        max_model_len=settings.max_model_len, kv_cache_bytes=settings.kv_cache_bytes,
        packed_copy=preflight.packed_copy_kept(device, settings.cpu_kernels, settings.cpu_isa), dense=dense,
        kv_dtype=settings.kv_cache_dtype,
    )  # fmt: skip
    for need in needs:
        log.info("preflight: %s", need.message)
    refusal = preflight.refusal(needs)
    if refusal:
        raise StartError(refusal)


def engine_config(settings: Settings, prepared: Prepared) -> Any:
    """The frozen engine.types.EngineConfig for the prepared model."""
    from engine.types import EngineConfig

    path = prepared.model_path
    is_gguf = path.suffix == ".gguf"
    return EngineConfig(
        model_path=str(path.parent if is_gguf else path),
        model_name=settings.model_id,
        gguf_file=path.name if is_gguf else None,
        device=prepared.device,
        dtype=prepared.dtype,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=settings.block_size,
        kv_cache_memory_fraction=settings.kv_cache_memory_fraction,
        kv_cache_bytes=settings.kv_cache_bytes,
        kv_cache_dtype=settings.kv_cache_dtype,
        cache_dir=str(settings.cache_dir),
        seed=settings.seed,
        trust_remote_code=settings.trust_remote_code,
        model_impl=settings.model_impl,
        cpu_kernels=settings.cpu_kernels,
        cpu_isa=settings.cpu_isa,
        weight_format=settings.weight_format,
        quantize=None if settings.quantize == "none" else settings.quantize,
        prefix_caching=settings.prefix_caching,
    )


def embedder_location(settings: Settings) -> tuple[Path, str] | None:
    """The embedding model's folder and served name, or None when --embedding-model none."""
    if settings.embedding_model.strip().lower() in ("", "none", "off"):
        return None
    from models.embedder import discoverable_name, resolve_embedding_model

    try:
        path, name = resolve_embedding_model(settings.embedding_model)
    except (ValueError, FileNotFoundError) as exc:
        raise StartError(f"--embedding-model: {exc}") from None
    return path, settings.embedding_served_name or discoverable_name(name)


# --- serving ---------------------------------------------------------------------------------------------


def serve(settings: Settings, prepared: Prepared) -> int:
    """uvicorn in this thread; the engine (and the embedder) load in a background thread meanwhile."""
    from app import create_app

    app = create_app(engine=None, settings=settings)
    server = http_server(settings, app)
    loader = Loader(app, server, engine_config(settings, prepared), prepared.embedder_at, prepared.device)
    threading.Thread(target=loader.run, name="peregrine-loader", daemon=True).start()
    log.info("listening on http://%s:%d%s (ready once the model is loaded)", settings.host, settings.port,
             settings.root_path)  # fmt: skip
    server.run()
    loader.shutdown()
    return 1 if loader.failed else 0


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


class Loader:
    """Loads the engine (and embedder) in the background, then switches the app's model routes on.
    A failed load stops the server, and `main` exits 1."""

    def __init__(self, app: Any, server: Any, cfg: Any, embedder_at: tuple[Path, str] | None, device: str):
        self.app, self.server, self.cfg, self.embedder_at, self.device = app, server, cfg, embedder_at, device
        self.engine: Any = None
        self.failed = False

    def run(self) -> None:
        try:
            self._load()
        except Exception:
            log.exception("loading the model failed; stopping the server")
            self.failed = True
            self.server.should_exit = True

    def _load(self) -> None:
        from models.engine_factory import build_async_engine

        load_embedder(self.app, self.embedder_at, self.device)
        engine = build_async_engine(self.cfg)
        engine.start()
        self.engine = engine
        self.app.state.engine = engine
        stats = engine.stats()
        log.info(
            "ready: %s on %s in %s, max_model_len %d, KV cache %d tokens (%d blocks of %d), max %d sequences, "
            "prefix caching %s",
            engine.model_name, engine.device, engine.dtype, engine.max_model_len, stats.kv_total_tokens,
            stats.kv_total_blocks, stats.block_size, self.cfg.max_num_seqs,
            "on (idle prefixes kept in the same KV cache)" if self.cfg.prefix_caching else "off",
        )  # fmt: skip

    def shutdown(self) -> None:
        if self.engine is not None:
            asyncio.run(self.engine.shutdown())


def serve_on_ray(settings: Settings, prepared: Prepared) -> int:
    """Several replicas behind Ray Serve's proxy (see serving/ray_serve.py); each loads its own engine."""
    try:
        from serving import ray_serve
    except ModuleNotFoundError as exc:
        log.error("--ray-replicas / --ray-autoscale need Ray: pip install -e '.[ray]' (%s)", exc)
        return 1
    return ray_serve.run(ray_plan(settings, prepared))


def ray_plan(settings: Settings, prepared: Prepared) -> Any:
    """What each Ray replica builds: the same engine config and embedder as `serve` (serving/ray_serve.py)."""
    from serving.ray_serve import ReplicaPlan

    embedder_at = prepared.embedder_at
    return ReplicaPlan(
        settings=settings,
        engine_config=engine_config(settings, prepared),
        embedder_path=str(embedder_at[0]) if embedder_at else None,
        embedder_name=embedder_at[1] if embedder_at else None,
    )


def ray_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder for a running cluster: `serve run main:ray_app model=... ray_replicas=2`,
    `serve deploy`, and KubeRay's RayService (`import_path: main:ray_app`, deploy/kuberay/rayservice.yaml).
    `args` are Settings field names, on top of the PEREGRINE_* environment, exactly like flags."""
    from serving import ray_serve

    settings = load_settings([_flag(name, value) for name, value in args.items()])
    configure_logging(settings.log_level)
    quiet_openmp_waits()
    return ray_serve.build_application(ray_plan(settings, prepare(settings)), ray_serve.cluster_gpus())


def _flag(name: str, value: Any) -> str:
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag}={value}"


if __name__ == "__main__":
    import main as this  # one copy of this module as a script and as `main` (main_models.py imports it)

    sys.exit(this.main())
