"""Start Peregrine: settings -> acquire (source, device, preflight, download) -> app -> uvicorn, with the engine
loading behind it.

    python main.py --help                     # every flag, with its default and environment variable
    python main.py                            # the bundled SmolLM2-135M-Instruct on 127.0.0.1:8000
    python main.py --model Qwen/Qwen2.5-7B-Instruct --device cuda --dtype bfloat16

The HTTP server starts before the model is loaded (once the loaders' libraries are imported): `/health`
answers while it loads and readiness (`/health/ready`) is 503 until the engine runs. Nothing heavy (torch, transformers) is imported before
the flags are parsed, so `--help` and a bad flag answer fast. Several models (`--model` more than once,
`--models-file`) start in serving/start.py; several replicas (`--ray-replicas`) in serving/ray_serve.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from config import Settings, load_settings, settings_or_exit

if TYPE_CHECKING:
    from models.acquire import Prepared

log = logging.getLogger("peregrine")


def main(argv: list[str] | None = None) -> int:
    settings = settings_or_exit(argv)
    configure_logging(settings.log_level)
    quiet_openmp_waits()
    log_cpu_isa(settings.cpu_isa)
    from models.acquire import StartError, acquire

    try:
        if settings.multi_model:
            from serving.start import serve_models

            return serve_models(settings)
        prepared = acquire(settings)
    except StartError as exc:
        log.error("%s", exc)
        return 1
    return (serve_on_ray if settings.use_ray else serve)(settings, prepared)


# libgomp's spins before an idle OpenMP worker sleeps (its default is 300,000, "about 3 ms"; PASSIVE alone is 0).
OPENMP_SPINS = "1000"


# The one environment write left in our code, and why: libgomp reads these variables once, when torch first loads
# it, so they cannot travel in a config object; main.py sets them before anything imports torch.
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


def log_cpu_isa(cap: str) -> None:
    """Log the instruction set the CPU kernels use under --cpu-isa (PEREGRINE_CPU_ISA); the cap itself travels to
    the kernels in the engine config (`EngineConfig.cpu_isa`)."""
    from engine.backends import cpu_features

    log.info("CPU kernels' instruction set: %s (this CPU: %s%s)", cpu_features.isa_level(cap=cap),
             cpu_features.detected_level(), "" if cap == "auto" else f", capped by --cpu-isa {cap}")  # fmt: skip


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", stream=sys.stderr
    )


# --- serving ---------------------------------------------------------------------------------------------


def serve(settings: Settings, prepared: Prepared) -> int:
    """uvicorn in this thread; the engine (and the embedder) load in one background thread meanwhile."""
    from app import create_app
    from models.acquire import import_libraries
    from serving.start import http_server

    import_libraries()  # before the loader thread starts, as the several-models start does
    app = create_app(engine=None, settings=settings)
    server = http_server(settings, app)
    loader = Loader(app, server, prepared)
    threading.Thread(target=loader.run, name="peregrine-loader", daemon=True).start()
    log.info("listening on http://%s:%d%s (ready once the model is loaded)", settings.host, settings.port,
             settings.root_path)  # fmt: skip
    server.run()
    loader.shutdown()
    return 1 if loader.failed else 0


class Loader:
    """Loads the engine (and embedder) in the background, then switches the app's model routes on.
    A failed load stops the server, and `main` exits 1."""

    def __init__(self, app: Any, server: Any, prepared: Prepared):
        self.app, self.server, self.prepared, self.cfg = app, server, prepared, prepared.engine_config
        self.engine: Any = None
        self.failed = False

    def run(self) -> None:
        from models.loader import LoadError

        try:
            self._load()
        except LoadError as exc:  # the user can fix it: one line, no traceback
            log.error("loading the model failed: %s; stopping the server", exc)
            self.failed = True
            self.server.should_exit = True
        except Exception:
            log.exception("loading the model failed; stopping the server")
            self.failed = True
            self.server.should_exit = True

    def _load(self) -> None:
        from models.engine_factory import build_async_engine, freeze_heap
        from serving.start import load_embedder

        load_embedder(self.app, self.prepared.embedder_at, self.prepared.device)
        engine = build_async_engine(self.cfg)
        freeze_heap()
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
        engine_config=prepared.engine_config,
        embedder_path=str(embedder_at[0]) if embedder_at else None,
        embedder_name=embedder_at[1] if embedder_at else None,
    )


def ray_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder for a running cluster: `serve run main:ray_app model=... ray_replicas=2`,
    `serve deploy`, and KubeRay's RayService (`import_path: main:ray_app`, deploy/kuberay/rayservice.yaml).
    `args` are Settings field names, on top of the PEREGRINE_* environment, exactly like flags."""
    from models.acquire import acquire
    from serving import ray_serve

    settings = load_settings([_flag(name, value) for name, value in args.items()])
    configure_logging(settings.log_level)
    quiet_openmp_waits()
    return ray_serve.build_application(ray_plan(settings, acquire(settings)), ray_serve.cluster_gpus())


def _flag(name: str, value: Any) -> str:
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag}={value}"


if __name__ == "__main__":
    sys.exit(main())
