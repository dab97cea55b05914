"""Ray Serve readiness on a real local cluster when not every replica can start: `--ray-replicas 2` with each
replica asking for more than half of the machine's CPUs, so Ray places one and the other waits for resources
for the whole run. The server must say "1 of 2 replicas ready" (its log line and `/health`), keep saying so,
serve requests from the one replica, and never claim two. (The two-of-two case is tests/ray/test_ray_serve.py,
whose fixture waits for the server's own "2 of 2 replicas ready" before its spread test.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install .[ray])")

from ray._private.utils import get_num_cpus  # noqa: E402  (the CPUs a local cluster gets: cgroup-aware)

from tests.ray.cluster_requests import HEADER  # noqa: E402
from tests.ray.cluster_support import (  # noqa: E402
    RayServer,
    cluster_pids,
    said,
    start_ray_server,
    stop_ray_server,
    wait_for_replicas,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START_TIMEOUT_S = 300.0  # Ray's cluster start plus one model load, on a busy 2-core machine
STILL_S = 8.0  # how long "1 of 2" must hold while the second replica cannot be placed


@pytest.fixture(scope="module")
def half_cluster(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    per_replica = round(get_num_cpus() * 0.6, 2)  # one fits, two do not
    args = ["--ray-replicas", "2", "--ray-num-cpus", str(per_replica), "--max-model-len", "512"]
    server = start_ray_server(Path(tiny_model_dir.path), tmp_path_factory.mktemp("ray-half"), args)
    try:
        wait_for_replicas(server.base_url, server.proc, server.log_path, count=1, wanted=2, timeout=START_TIMEOUT_S)
        yield server
    finally:
        stop_ray_server(server)


def test_one_of_two_replicas_says_so_and_serves(half_cluster: RayServer) -> None:
    health = httpx.get(f"{half_cluster.base_url}/health", timeout=30).json()
    states = sorted(r["state"] for r in health["replicas"])
    assert states == ["RUNNING", "STARTING"], states  # the other waits to be placed (Serve: STARTING)
    model = httpx.get(f"{half_cluster.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    answer = httpx.post(f"{half_cluster.base_url}/v1/completions", timeout=120,
                        json={"model": model, "prompt": "The quick brown fox", "max_tokens": 4})  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER] == health["replica"]  # the one ready replica served it

    deadline = time.monotonic() + STILL_S
    while time.monotonic() < deadline:  # it keeps saying so (the second replica cannot be placed at all)
        assert httpx.get(f"{half_cluster.base_url}/health", timeout=30).json()["replicas_ready"] == (
            "1 of 2 replicas ready")
        time.sleep(1.0)
    assert said(half_cluster.log_path, "1 of 2 replicas ready")
    assert not said(half_cluster.log_path, "2 of 2 replicas ready")
    assert cluster_pids(half_cluster.ray_tmpdir)
