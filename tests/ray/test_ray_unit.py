"""The Ray Serve wiring without a cluster: deployment options from Settings, the replica middleware.

Fast (no Ray cluster is started); they need the ray extra only because serving/ray_serve.py imports Ray.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install .[ray])")

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from config import Settings  # noqa: E402
from serving.ray_readiness import DeploymentView  # noqa: E402
from serving.ray_serve import (  # noqa: E402
    REPLICA_HEADER,
    ReplicaMiddleware,
    deployment_options,
    http_options,
    replica_device,
    replica_gpus,
    view_of,
)


def settings(**kwargs) -> Settings:
    return Settings(embedding_model="none", **kwargs)


def test_fixed_replicas_and_per_replica_resources() -> None:
    options = deployment_options(settings(ray_replicas=3, ray_num_cpus=0.5, max_num_seqs=8, max_queue=10), 0)
    assert options["num_replicas"] == 3
    assert "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert options["max_ongoing_requests"] == 8  # one full batch per replica; the rest waits in Ray's router
    assert options["max_queued_requests"] == 10


def test_autoscaling_follows_ongoing_requests_with_documented_defaults() -> None:
    options = deployment_options(settings(ray_autoscale="1:4", max_num_seqs=32), 0)
    assert "num_replicas" not in options
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"], scaling["max_replicas"]) == (1, 1, 4)
    assert scaling["target_ongoing_requests"] == 16  # half a batch, see docs/scale-out.md
    explicit = deployment_options(settings(ray_autoscale="2:2", ray_target_ongoing_requests=5), 0)
    assert explicit["autoscaling_config"]["target_ongoing_requests"] == 5


def test_unbounded_router_queue_when_max_queue_is_zero() -> None:
    assert deployment_options(settings(ray_replicas=2, max_queue=0), 0)["max_queued_requests"] == -1


@pytest.mark.parametrize(
    ("device", "num_gpus", "cluster_gpus", "expected"),
    [
        ("auto", None, 4, 1.0),  # CUDA cluster: each replica gets its own GPU
        ("auto", None, 0, 0.0),
        ("cuda:1", None, 2, 1.0),
        ("cpu", None, 8, 0.0),  # asked for CPU: GPUs are left alone
        ("cpu", 0.5, 8, 0.5),  # an explicit setting wins
    ],
)
def test_gpus_per_replica(device: str, num_gpus: float | None, cluster_gpus: float, expected: float) -> None:
    assert replica_gpus(settings(device=device, ray_num_gpus=num_gpus), cluster_gpus) == expected


def test_inside_a_replica_cuda_n_is_the_replica_gpu() -> None:
    assert replica_device("cuda:3", 1) == "cuda"
    assert replica_device("cuda", 1) == "cuda"
    assert replica_device("cpu", 0) == "cpu"


def test_proxy_listens_where_main_would() -> None:
    options = http_options(settings(host="0.0.0.0", port=9001, root_path="/llm", keep_alive=7))
    assert options == {"host": "0.0.0.0", "port": 9001, "root_path": "/llm", "keep_alive_timeout_s": 7}


# --- the replica middleware ---------------------------------------------------------------------------------


def _app(replicas: list[dict] | None) -> ReplicaMiddleware:
    async def health(request):
        return JSONResponse({"status": "ok", "engine": "ready"})

    async def tokens(request):
        async def gen():
            for i in range(3):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def missing(request):
        return JSONResponse({"error": {"message": "nope"}}, status_code=404)

    async def view():  # as the Serve controller would list them; None: the controller does not answer
        return None if replicas is None else DeploymentView("RUNNING", "", len(replicas), replicas)

    inner = Starlette(routes=[Route("/health", health), Route("/stream", tokens), Route("/missing", missing)])
    return ReplicaMiddleware(inner, replica_id="abc123", view=view)


async def _get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
        return await client.get(path)


async def test_every_response_names_the_replica() -> None:
    app = _app([])
    stream = await _get(app, "/stream")
    assert stream.headers[REPLICA_HEADER] == "abc123"
    assert stream.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    missing = await _get(app, "/missing")
    assert (missing.status_code, missing.headers[REPLICA_HEADER]) == (404, "abc123")


async def test_health_keeps_the_apps_answer_and_adds_the_replicas() -> None:
    replicas = [
        {"id": "abc123", "state": "RUNNING", "pid": 11},
        {"id": "def456", "state": "STARTING", "pid": 12},
    ]
    response = await _get(_app(replicas), "/health")
    assert response.status_code == 200
    assert response.headers[REPLICA_HEADER] == "abc123"
    assert int(response.headers["content-length"]) == len(response.content)
    assert json.loads(response.content) == {"status": "ok", "engine": "ready", "replica": "abc123",
                                            "replicas": replicas,
                                            "replicas_ready": "1 of 2 replicas ready"}  # fmt: skip


async def test_health_answers_when_the_controller_does_not() -> None:
    response = await _get(_app(None), "/health")
    assert response.status_code == 200
    assert response.json()["replicas"] is None
    assert response.json()["replicas_ready"] is None  # unknown, not "0 of 0"


# --- the controller's answer -------------------------------------------------------------------------------


def _details(states: list[str], target: int, status: str = "DEPLOYING") -> dict:
    """Serve's instance details, shaped as the controller's `get_serve_instance_details` returns them."""
    replicas = [{"replica_id": f"r{i}", "state": state, "pid": 100 + i, "node_id": "n", "node_ip": "127.0.0.1",
                 "start_time_s": 1.0} for i, state in enumerate(states)]  # fmt: skip
    deployment = {"status": "UPDATING", "target_num_replicas": target, "replicas": replicas}
    return {"applications": {"peregrine": {"status": status, "message": "why", "deployments": {
        "Peregrine": deployment}}}}  # fmt: skip


def test_view_of_reads_status_target_and_replicas() -> None:
    view = view_of(_details(["RUNNING", "STARTING"], 2))
    assert (view.status, view.message, view.wanted, view.running) == ("DEPLOYING", "why", 2, {"r0"})
    assert view.replicas[1] == {"id": "r1", "state": "STARTING", "pid": 101, "node_id": "n",
                                "node_ip": "127.0.0.1", "started_at": 1.0}  # fmt: skip
    assert view_of({"applications": {}}) is None  # not listed yet: no view, not "0 of 0"
    assert view_of(_details([], 1, status="DEPLOY_FAILED")).failed
    failed_early = {"applications": {"peregrine": {"status": "DEPLOY_FAILED", "message": "bad", "deployments": {}}}}
    assert view_of(failed_early).failed and view_of(failed_early).message == "bad"  # said, not waited on
