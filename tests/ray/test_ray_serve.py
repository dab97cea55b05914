"""Peregrine on Ray Serve, end to end: `python main.py --ray-replicas 2` on a local Ray cluster.

One cluster for the whole module (starting Ray is the slow part): two replicas of a tiny random Llama, each
with half a CPU, behind Ray's proxy on a free loopback port, with an API key. The cluster is private to the
test: its own RAY_TMPDIR, a loopback-only node address, no dashboard. Every process it starts inherits that
RAY_TMPDIR, which is how the last test (and the fixture's safety net) finds and checks them by PID.

"Correct" means equal to the answer the same model gives through the same app without Ray: the reference
answers come from `create_app` over an in-process engine on the same folder, the same greedy request.
The tests run in file order; the shutdown test is last.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.ray.cluster_requests import (
    HEADER,
    REQUEST_TIMEOUT_S,
    KillOnFirstChunk,
    ask,
    ask_raw,
    long_stream,
    outcome,
    timed,
)
from tests.ray.cluster_support import (
    cluster_pids,
    describe,
    next_event,
    start_ray_server,
    stop_ray_server,
    wait_for_replicas,
    wait_until,
)

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install .[ray])")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
API_KEY = "ray-test-key"
START_TIMEOUT_S = 300.0  # Ray's cluster start plus two model loads, on a busy 2-core machine
STOP_TIMEOUT_S = 90.0
MAX_MODEL_LEN = 4096
PROMPTS = [
    "The quick brown fox",
    "Peregrine falcons are",
    "Continuous batching lets",
    "Hello world! How are",
    "Paged attention stores",
    "Numbers: 0 1 2",
    "def add(a, b):",
    "Café, naïve, and",
    "The lazy dog",
    "Keys and values in",
]
SHORT = 24  # tokens per answer in the correctness test
_MEDIA_TYPES = {"sse": "text/event-stream", "ndjson": "application/x-ndjson"}


@dataclass
class Cluster:
    base_url: str
    proc: subprocess.Popen
    ray_tmpdir: str
    log_path: Path
    model_dir: Path
    model_id: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S)  # fmt: skip


# --- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_model_dir(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's tiny Llama with a 4096-token context, so one streamed answer can run for thousands of steps."""
    path = tmp_path_factory.mktemp("ray-model") / "tiny-llama-4k"
    shutil.copytree(tiny_model_dir.path, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cluster(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", "64MiB", "--api-keys", API_KEY,
            "--ray-replicas", "2", "--ray-num-cpus", "0.5"]  # fmt: skip
    server = start_ray_server(long_model_dir, tmp_path_factory.mktemp("ray-server"), args)
    try:
        wait_for_replicas(server.base_url, server.proc, server.log_path, count=2, timeout=START_TIMEOUT_S)
        model_id = httpx.get(f"{server.base_url}/v1/models", headers=_auth(), timeout=30).json()["data"][0]["id"]
        yield Cluster(server.base_url, server.proc, server.ray_tmpdir, server.log_path, long_model_dir, model_id)
    finally:
        stop_ray_server(server)


@pytest.fixture(scope="module")
def reference(long_model_dir: Path) -> Iterator[Reference]:
    """Answers from the same app over an in-process engine on the same model folder (no Ray, no sockets)."""
    ref = Reference(long_model_dir)
    yield ref
    ref.close()


class Reference:
    """Greedy answers of the non-Ray app (`create_app` over an in-process engine), computed once each.

    The engine is loaded on first use and kept for the module; requests go through the app with
    httpx's ASGI transport and the openai SDK, concurrently (greedy answers do not depend on batching).
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.engine = None
        self.app = None
        self.model_id = ""
        self._cache: dict[tuple, str] = {}

    async def answer(self, kind: str, prompt: str, max_tokens: int) -> str:
        await self.prepare([(kind, prompt, max_tokens)])
        return self._cache[(kind, prompt, max_tokens)]

    async def prepare(self, keys: list[tuple[str, str, int]]) -> None:
        missing = sorted(set(keys) - set(self._cache))
        if not missing:
            return
        self._load()
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://reference") as http:
            client = openai.AsyncOpenAI(base_url="http://reference/v1", api_key="none", http_client=http)
            answers = await asyncio.gather(*(ask(client, self.model_id, *key) for key in missing))
        self._cache |= dict(zip(missing, answers, strict=True))

    def _load(self) -> None:
        if self.engine is not None:
            return
        import torch

        from app import create_app
        from config import Settings
        from engine.types import EngineConfig
        from models.engine_factory import build_async_engine

        torch.set_num_threads(
            1
        )  # like a replica (Ray sets OMP_NUM_THREADS=1); spinning threads are slow here
        settings = Settings(model=str(self.model_dir), device="cpu", dtype="float32", embedding_model="none",
                            max_model_len=MAX_MODEL_LEN)  # fmt: skip
        self.model_id = settings.model_id
        self.engine = build_async_engine(EngineConfig(
            model_path=str(self.model_dir), model_name=self.model_id, device="cpu", dtype="float32",
            max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20))  # fmt: skip
        self.engine.start()
        self.app = create_app(self.engine, settings)

    def close(self) -> None:
        if self.engine is not None:
            asyncio.run(self.engine.shutdown())


# --- the tests ---------------------------------------------------------------------------------------------


async def test_concurrent_requests_are_correct_and_spread(cluster: Cluster, reference: Reference) -> None:
    """20 concurrent greedy requests (chat and completions, stream and not) through the proxy with the
    openai SDK: each answer equals the non-Ray answer, and both replicas served some (by the header)."""
    cases = [(("chat", "completion")[i % 2], PROMPTS[i // 2], bool(i // 2 % 2)) for i in range(20)]
    await reference.prepare([(kind, prompt, SHORT) for kind, prompt, _ in cases])
    client = cluster.client()
    results = await asyncio.gather(*(
        timed(ask_raw(client, cluster.model_id, kind, prompt, SHORT, stream)) for kind, prompt, stream in cases
    ))  # fmt: skip
    for (kind, prompt, stream), (text, finish, replica) in zip(cases, results, strict=True):
        assert text == await reference.answer(kind, prompt, SHORT), (kind, prompt, stream)
        assert finish == "length"
        assert replica
    served = {replica for _, _, replica in results}
    assert len(served) == 2, f"one replica served all 20 requests: {served}"
    assert served <= {r["id"] for r in _health(cluster.base_url)["replicas"]}


@pytest.mark.parametrize(("route", "fmt"), [("completions", "sse"), ("chat/completions", "ndjson")])
def test_stream_is_not_buffered_and_disconnect_aborts(cluster: Cluster, route: str, fmt: str) -> None:
    """The first chunk of a long answer reaches the client before the replica has generated the answer's
    last token, and leaving then aborts the request in that replica's engine.

    The client reads one event and closes the connection. Had the proxy (or anything in between) buffered
    the stream, that first event would only have arrived after all `max_tokens` tokens existed. Instead the
    serving replica (named by the response header) stops far short of `max_tokens`: the disconnect reached
    its engine while it was still generating. No other request runs meanwhile, so the replica's counters
    belong to this one.
    """
    max_tokens = MAX_MODEL_LEN - 64  # as long as the context allows: far more than any machine makes meanwhile
    body = {"model": cluster.model_id, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    body |= (
        {"prompt": PROMPTS[0]}
        if route == "completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    before = _loads(cluster.base_url)
    with _http(cluster) as http, http.stream("POST", f"/v1/{route}?format={fmt}", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith(_MEDIA_TYPES[fmt])
        replica = response.headers[HEADER]
        first = next_event(response.iter_lines(), fmt)
        assert first["choices"][0]["finish_reason"] is None
    after = wait_until(lambda: _idle(_load_of(cluster.base_url, replica)), timeout=120, what="the abort")
    generated = after["generated_tokens_total"] - before[replica]["generated_tokens_total"]
    assert 0 < generated < max_tokens, f"{generated} tokens generated for a stream left after its first event"


def test_stream_arrives_event_by_event(cluster: Cluster) -> None:
    """A full stream through the proxy: one event per token (or few), ending with finish_reason and [DONE]."""
    max_tokens = 200
    body = {"model": cluster.model_id, "prompt": PROMPTS[3], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with _http(cluster) as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(events) > max_tokens // 4
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"


def test_auth_and_errors_pass_through(cluster: Cluster) -> None:
    """The replica's auth and error envelope reach the client unchanged, with the replica header."""
    no_key = httpx.post(f"{cluster.base_url}/v1/completions", json={"model": cluster.model_id, "prompt": "x"})
    assert no_key.status_code == 401
    assert no_key.json()["error"]["type"]
    assert no_key.headers[HEADER]
    bad_model = httpx.post(f"{cluster.base_url}/v1/completions", headers=_auth(),
                           json={"model": "no-such-model", "prompt": "x", "max_tokens": 2})  # fmt: skip
    assert bad_model.status_code == 404
    assert bad_model.json()["error"]["param"] == "model"
    too_long = httpx.post(f"{cluster.base_url}/v1/completions", headers=_auth(),
                          json={"model": cluster.model_id, "prompt": "x", "max_tokens": MAX_MODEL_LEN + 1})  # fmt: skip
    assert too_long.status_code == 400


def test_health_lists_the_replicas(cluster: Cluster) -> None:
    health = _health(cluster.base_url)
    assert health["status"] == "ok"
    assert health["replicas_ready"] == "2 of 2 replicas ready"
    assert [r["state"] for r in health["replicas"]] == ["RUNNING", "RUNNING"]
    assert health["replica"] in {r["id"] for r in health["replicas"]}
    assert all(isinstance(r["pid"], int) and r["pid"] > 0 for r in health["replicas"])


async def test_killed_replica_errors_its_requests_and_comes_back(
    cluster: Cluster, reference: Reference
) -> None:
    """SIGKILL one replica's process while both serve long requests: nothing hangs, nothing ends silently.
    The kill lands, synchronously, when the first stream gets its first chunk: that stream has about 4,000
    tokens still to come, so it and the other streams on the killed replica are in flight (no event loop turn
    passes between seeing the chunk and the kill; with 1,000 tokens, a CI run under load once saw the tiny
    model's whole stream leave the replica before the client read its first chunk). A stream on the killed
    replica either raises or (if all of it had left the replica before the kill) is complete and correct; the
    one that triggered the kill raises. Every request that completes is correct. Ray starts a new replica, and
    requests sent once it is up succeed."""
    max_tokens, prompt = MAX_MODEL_LEN - 64, PROMPTS[2]  # long enough to be in flight on every replica at the kill
    replicas = {r["id"]: r["pid"] for r in _health(cluster.base_url)["replicas"]}
    client = cluster.client()
    killer = KillOnFirstChunk(replicas)
    streams = [asyncio.create_task(long_stream(client, cluster.model_id, prompt, max_tokens, killer))
               for _ in range(10)]  # fmt: skip
    plain = [asyncio.create_task(outcome(ask_raw(client, cluster.model_id, "completion", prompt, max_tokens,
                                                   stream=False))) for _ in range(4)]  # fmt: skip
    victim = await killer.victim()
    results = await asyncio.gather(*streams)
    outcomes = await asyncio.gather(*plain)
    # The reference answer is computed while Ray brings the replacement replica up.
    wait_for_replacement = asyncio.to_thread(
        wait_until, lambda: _replaced(_health(cluster.base_url), victim, replicas[victim]), timeout=180,
        what="a replacement replica")  # fmt: skip
    expected, health = await asyncio.gather(
        reference.answer("completion", prompt, max_tokens), wait_for_replacement
    )

    assert not [r for r in results if r.silent], f"a stream ended without finish_reason or error: {results}"
    assert killer.trigger.error is not None, f"the stream that saw the kill completed: {killer.trigger}"
    for r in results:
        assert r.error is not None or (r.finish_reason == "length" and r.text == expected), r
    for result in outcomes:
        assert isinstance(result, openai.APIError) or result[0] == expected, result

    (new_replica,) = {r["id"] for r in health["replicas"]} - set(replicas)
    assert _load_of(cluster.base_url, new_replica)["status"] == "ready"  # the proxy routes to it
    cases = [
        (kind, p, stream) for kind in ("chat", "completion") for p in PROMPTS[:2] for stream in (False, True)
    ]
    after = await asyncio.gather(*(
        timed(ask_raw(client, cluster.model_id, kind, p, SHORT, stream)) for kind, p, stream in cases
    ))  # fmt: skip
    for (kind, p, _), (text, finish, _) in zip(cases, after, strict=True):
        assert text == await reference.answer(kind, p, SHORT)
        assert finish == "length"


def test_shutdown_leaves_no_ray_processes(cluster: Cluster) -> None:
    """SIGTERM to main.py removes the app and stops the local cluster it started: every process of that
    cluster (they all carry its RAY_TMPDIR) is gone, and main.py exits 0."""
    assert cluster_pids(cluster.ray_tmpdir), "found no process of the test cluster to begin with"
    os.kill(cluster.proc.pid, signal.SIGTERM)
    returncode = cluster.proc.wait(timeout=STOP_TIMEOUT_S)
    left = wait_until(lambda: not cluster_pids(cluster.ray_tmpdir) or None, timeout=30, what="no Ray process",
                       fail=False)  # fmt: skip
    assert left, f"Ray processes left behind: {describe(cluster_pids(cluster.ray_tmpdir))}"
    assert returncode == 0, cluster.log_path.read_text(errors="replace")[-4000:]


# --- helpers: health, replicas, processes ------------------------------------------------------------------


def _http(cluster: Cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.base_url, headers=_auth(), timeout=REQUEST_TIMEOUT_S)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _health(base_url: str) -> dict:
    response = httpx.get(f"{base_url}/health", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _load_of(base_url: str, replica: str, tries: int = 200) -> dict:
    """This replica's engine load (`GET /health/engine`), asked until the proxy routes it to that replica."""
    for _ in range(tries):
        response = httpx.get(f"{base_url}/health/engine", headers=_auth(), timeout=30)
        assert response.status_code == 200, response.text
        if response.headers[HEADER] == replica:
            return response.json()
    raise AssertionError(f"{tries} requests to /health/engine and none reached replica {replica}")


def _loads(base_url: str) -> dict[str, dict]:
    ids = {r["id"] for r in _health(base_url)["replicas"]}
    return {rid: _load_of(base_url, rid) for rid in ids}


def _idle(load: dict) -> dict | None:
    return load if load["running"] == 0 and load["waiting"] == 0 else None


def _replaced(health: dict, victim: str, victim_pid: int) -> dict | None:
    """The health answer once two replicas run again and neither is the killed one."""
    replicas = health.get("replicas") or []
    running = [r for r in replicas if r["state"] == "RUNNING"]
    fresh = all(r["id"] != victim and r["pid"] != victim_pid for r in replicas)
    return health if len(running) == len(replicas) == 2 and fresh else None
