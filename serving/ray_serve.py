"""Scale out on Ray Serve: N replicas of the same FastAPI app, each with its own engine, behind Ray's proxy.

`python main.py --ray-replicas N` (or `--ray-autoscale MIN:MAX`) lands in `run()`. It joins the Ray cluster
named by `--ray-address` / `RAY_ADDRESS`, or starts a local one, and deploys one Serve application:

    client -> Ray Serve proxy (host:port, the single HTTP entry point) -> replica 1..N
                                                                           create_app(own engine, settings)

Each replica is a Ray actor that loads the model once in `__init__`, starts its own engine loop, and serves
the very app `main.py` serves without Ray (`app.create_app`): same routes, errors, auth and limits. Ray's
proxy forwards the ASGI messages one by one, so SSE / NDJSON streams are not buffered, and a client that
goes away cancels the replica's handler, which aborts the request in that replica's engine.

What Ray adds on top, here and nowhere else:
- every response carries `x-peregrine-replica: <replica id>` (a pure ASGI middleware, streaming-safe);
- `GET /health` also lists the deployment's replicas (id, state, pid, node) as the Serve controller sees
  them, so an operator sees the spread and the restarts;
- `check_health` turns a dead engine loop into an unhealthy replica, which Ray replaces.

Ray is an optional extra (`pip install .[ray]`); only `main.py`'s Ray branch imports this module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import ray
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from config import Settings, device_kind
from engine.types import EngineConfig
from serving.ray_readiness import (
    DeploymentView,
    Readiness,
    ReadinessWatch,
    probe_replica,
    probe_url,
    readiness,
)

log = logging.getLogger("peregrine.ray")

APP_NAME = "peregrine"
DEPLOYMENT_NAME = "Peregrine"
REPLICA_HEADER = "x-peregrine-replica"
CONTROLLER_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ReplicaPlan:
    """What every replica needs to build what `main.py` builds in one process. Pickled to each replica.

    `engine_config.model_path` must exist on every node that runs a replica (one machine: it does; several:
    a shared download dir, or the same path prepared on each node, see docs/scale-out.md).
    """

    settings: Settings
    engine_config: EngineConfig
    embedder_path: str | None = None  # a local embedding model folder; None: /v1/embeddings is off
    embedder_name: str | None = None  # the embedder runs on the replica's own device (or the CPU)


# --- deployment options (pure: no Ray calls) -------------------------------------------------------------


def deployment_options(settings: Settings, cluster_gpus: float) -> dict[str, Any]:
    """Serve deployment options from Settings: replicas or autoscaling, per-replica resources, queueing.

    Each replica admits up to `max_num_seqs` requests (a full batch); more wait in Ray's router, where they
    can go to whichever replica frees up first, and past `max_queue` waiting requests the proxy answers 503.
    """
    options: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": settings.ray_num_cpus,
            "num_gpus": replica_gpus(settings, cluster_gpus),
        },
        "max_ongoing_requests": settings.max_num_seqs,
        "max_queued_requests": settings.max_queue if settings.max_queue > 0 else -1,
        "graceful_shutdown_timeout_s": settings.shutdown_timeout,
        "health_check_period_s": 10.0,
    }
    bounds = settings.ray_autoscale_bounds
    if bounds is None:
        options["num_replicas"] = settings.ray_replicas
    else:
        options["autoscaling_config"] = autoscaling_config(settings, *bounds)
    return options


def autoscaling_config(settings: Settings, min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """Scale on ongoing requests per replica (running + queued at the replica), Ray's own signal.

    The target defaults to half a batch: a replica that is half full on average still has room for bursts,
    and one more replica is added before requests start to queue. Delays are Ray's defaults (scale up
    after 30 s above target, down after 600 s below), so a short burst does not reload a model.
    """
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "initial_replicas": min_replicas,
        "target_ongoing_requests": settings.ray_target_ongoing_requests or max(1, settings.max_num_seqs // 2),
        "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0,
    }


def replica_gpus(settings: Settings, cluster_gpus: float) -> float:
    """GPUs per replica: the setting if given; else one GPU each when the device allows CUDA and the
    cluster has GPUs (Ray then sets CUDA_VISIBLE_DEVICES, so each replica sees only its own), else none."""
    if settings.ray_num_gpus is not None:
        return settings.ray_num_gpus
    wants_cuda = device_kind(settings.device) in ("auto", "cuda")
    return 1.0 if wants_cuda and cluster_gpus > 0 else 0.0


def replica_device(device: str, num_gpus: float) -> str:
    """Inside a replica Ray exposes only the replica's own GPU(s), so `cuda:N` becomes `cuda` (device 0)."""
    return "cuda" if device_kind(device) == "cuda" and num_gpus > 0 else device


# --- the replica -----------------------------------------------------------------------------------------


class ReplicaMiddleware:
    """Names the replica in every response (`x-peregrine-replica`) and adds the replica list to `/health`.

    Pure ASGI, so streamed bodies pass through message by message. Only the small `/health` body is read
    and rewritten: the app's own health answer (status code and fields) plus `replica` (the one answering),
    `replicas` (all of the deployment's) and `replicas_ready` ("1 of 2 replicas ready": RUNNING of the
    deployment's target, serving/ray_readiness.py). This replica's engine load is `GET /health/engine`, as without
    Ray; the header says which replica answered it.
    """

    def __init__(self, app: ASGIApp, replica_id: str, view: Any) -> None:
        self.app = app
        self.replica_id = replica_id
        self.view = view  # async () -> DeploymentView | None
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope["method"] == "GET" and scope["path"] == "/health":
            await self._health(scope, receive, send)
        else:
            await self.app(scope, receive, self._with_header(send))

    def _with_header(self, send: Send) -> Send:
        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return send_with_header

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        start: Message = {}
        body = bytearray()

        async def capture(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            else:
                body.extend(message.get("body", b""))

        await self.app(scope, receive, capture)
        payload = json.loads(body) if body else {}
        view = await self.view()
        payload |= {"replica": self.replica_id, "replicas": view.replicas if view is not None else None,
                    "replicas_ready": readiness(view).text() if view is not None else None}  # fmt: skip
        data = json.dumps(payload).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",)]
        headers += [(b"content-length", str(len(data)).encode()), self.header]
        await send({"type": "http.response.start", "status": start.get("status", 200), "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def deployment_view(app_name: str = APP_NAME, deployment: str = DEPLOYMENT_NAME) -> DeploymentView | None:
    """The deployment as the Serve controller sees it (from inside a replica); None if it does not answer."""
    try:
        controller = _controller()
        details = await asyncio.wait_for(
            controller.get_serve_instance_details.remote(), timeout=CONTROLLER_TIMEOUT_S
        )
    except Exception as exc:  # health must answer even when the controller is busy or restarting
        log.warning("could not list replicas: %s", exc)
        return None
    return view_of(details, app_name, deployment)


def driver_view(app_name: str = APP_NAME, deployment: str = DEPLOYMENT_NAME) -> DeploymentView | None:
    """The same view, from the driver (blocking); None if the controller does not answer in time."""
    try:
        details = ray.get(_controller().get_serve_instance_details.remote(), timeout=CONTROLLER_TIMEOUT_S)
    except Exception as exc:  # the readiness watch asks again next second
        log.debug("could not ask the Serve controller: %s", exc)
        return None
    return view_of(details, app_name, deployment)


def _controller() -> Any:
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


def view_of(details: dict, app_name: str = APP_NAME, deployment: str = DEPLOYMENT_NAME) -> DeploymentView | None:
    """Serve's instance details -> the app's status, the deployment's target count and replicas (None while
    the controller does not list the deployment yet)."""
    app = details.get("applications", {}).get(app_name)
    if app is None:
        return None
    dep = app.get("deployments", {}).get(deployment)
    if dep is None and _value(app.get("status")) != "DEPLOY_FAILED":  # failed before the deployment was made
        return None
    dep = dep or {}
    replicas = [_replica_entry(r) for r in dep.get("replicas", [])]
    return DeploymentView(status=_value(app.get("status")), message=app.get("message") or "",
                          wanted=int(dep.get("target_num_replicas", 0)), replicas=replicas)  # fmt: skip


def _value(enum_or_str: Any) -> Any:
    return getattr(enum_or_str, "value", enum_or_str)


def _replica_entry(replica: dict) -> dict:
    return {
        "id": replica.get("replica_id"),
        "state": _value(replica.get("state")),
        "pid": replica.get("pid"),
        "node_id": replica.get("node_id"),
        "node_ip": replica.get("node_ip"),
        "started_at": replica.get("start_time_s"),
    }


@serve.ingress()
class PeregrineReplica:
    """One replica: its own engine (and embedder), built once, serving `create_app`'s app."""

    def __init__(self, plan: ReplicaPlan) -> None:
        from models.engine_factory import build_async_engine, freeze_heap

        self.plan = plan
        self.replica_id = serve.get_replica_context().replica_tag
        self.engine_config = replica_config(plan)
        log.info("replica %s (pid %d) loading %s on %s", self.replica_id, os.getpid(), plan.engine_config.model_path,
                 self.engine_config.device)  # fmt: skip
        self.engine = build_async_engine(self.engine_config)
        self.embedder = self._load_embedder(self.engine.device)
        freeze_heap()
        self.engine.start()

    def _load_embedder(self, device: str) -> Any:
        if self.plan.embedder_path is None:
            return None
        from models.embedder import Embedder

        return Embedder.from_path(self.plan.embedder_path, device=device, name=self.plan.embedder_name)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from app import create_app

        app = create_app(self.engine, self.plan.settings, self.embedder)
        app.add_middleware(ReplicaMiddleware, replica_id=self.replica_id, view=deployment_view)
        return app

    def check_health(self) -> None:
        """Called by the Serve controller; raising marks the replica unhealthy and Ray replaces it."""
        if not self.engine.stats().alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop has stopped")

    async def __del__(self) -> None:
        await self.engine.shutdown()


def replica_config(plan: ReplicaPlan) -> EngineConfig:
    """The engine config with the device and dtype as the user gave them, for the engine's loader to resolve
    where the model runs rather than on the driver: a CPU-only head can deploy onto GPU nodes, and each replica
    sees only the GPU(s) Ray gave it."""
    device = replica_device(plan.settings.device, len(ray.get_gpu_ids()))
    return replace(plan.engine_config, device=device, dtype=plan.settings.dtype)


def build_application(plan: ReplicaPlan, cluster_gpus: float = 0.0) -> serve.Application:
    """The Serve application: the replica class with options from Settings, bound to the plan."""
    options = deployment_options(plan.settings, cluster_gpus)
    return serve.deployment(PeregrineReplica, name=DEPLOYMENT_NAME, **options).bind(plan)


# --- the driver (main.py's Ray branch) ------------------------------------------------------------------


def connect(settings: Settings) -> bool:
    """Join the cluster at `settings.ray_address` (also read from RAY_ADDRESS), or start a local one.

    Returns True when this process started the cluster (and so must stop it). A local cluster gets no
    dashboard and the CPUs (and GPUs) of this machine; its files go to Ray's default (RAY_TMPDIR or /tmp/ray).
    Peregrine's own code travels with the job (`py_modules`), so every node runs the driver's version of it;
    the third-party packages (torch, transformers, ...) must be installed on every node.
    """
    address = settings.ray_address or "local"
    ray.init(address=address, include_dashboard=False, logging_level=settings.log_level.upper(),
             runtime_env={"py_modules": peregrine_modules()})  # fmt: skip
    return address == "local"


def peregrine_modules() -> list[ModuleType]:
    """The modules a replica imports: the app, models and engine packages and config."""
    import app
    import config
    import engine
    import models

    return [app, models, engine, config]


def run(plan: ReplicaPlan) -> int:
    """Deploy the app on Ray Serve and serve until SIGINT / SIGTERM; then remove it (and the local cluster).
    Says how many replicas are ready, exactly, at the first and at every change (serving/ray_readiness.py).
    Returns the exit status: 0 after a signal, 1 if the deployment failed (the replicas' errors are in
    the log above, forwarded by Ray)."""
    settings = plan.settings
    started_cluster = connect(settings)
    watch = readiness_watch(settings)
    try:
        serve.start(http_options=http_options(settings))
        serve._run(build_application(plan, cluster_gpus()), name=APP_NAME, route_prefix="/", _blocking=False)
        _install_stop(watch.stop)
        first = watch.wait_first()
        if first is not None and first.failed:  # Serve gave up on the replicas (e.g. the model does not load)
            log.error("deploying on Ray Serve failed: %s", first.message)
            return 1
        watch.keep_watching()
        watch.stop.wait()
        return 0
    finally:
        watch.close()
        _stop(started_cluster)


def readiness_watch(settings: Settings) -> ReadinessWatch:
    """The driver's watch: the controller's view, probes through our own proxy, one log line per change."""
    url = probe_url(settings.host, settings.port, settings.root_path)
    where = f"http://{settings.host}:{settings.port}"

    def announce(now: Readiness) -> None:
        log.info("Peregrine on Ray Serve at %s: %s%s", where, now.text(), _scale_text(settings, now))

    return ReadinessWatch(driver_view, lambda: probe_replica(url, REPLICA_HEADER), announce)


def cluster_gpus() -> float:
    """GPUs in the connected Ray cluster (all nodes)."""
    return float(ray.cluster_resources().get("GPU", 0.0))


def http_options(settings: Settings) -> dict[str, Any]:
    """The proxy listens where `main.py` would: host, port, root path and keep-alive from Settings."""
    return {"host": settings.host, "port": settings.port, "root_path": settings.root_path,
            "keep_alive_timeout_s": settings.keep_alive}  # fmt: skip


def _scale_text(settings: Settings, now: Readiness) -> str:
    bounds = settings.ray_autoscale_bounds
    scale = f" (autoscaling {bounds[0]}..{bounds[1]} replicas)" if bounds else ""
    return scale + ("" if now.complete else "; waiting for the rest")


def _install_stop(stop: threading.Event) -> None:
    """SIGINT / SIGTERM end the serving (main thread: Python runs signal handlers there)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _stop(started_cluster: bool) -> None:
    """Remove our application; if this process started the cluster, stop Serve and the cluster too."""
    try:
        if started_cluster:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
