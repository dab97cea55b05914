"""Overload, schema fuzzing and a bounded soak against a real server on the tiny model (issue 5).

The server admits max_num_seqs + max_queue = 2 + 2 generation requests at once. After each test the
engine must hold nothing: no running or waiting sequence, no KV block in use, no HTTP request in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
from _tiny_server import HeldUpload, TinyServer, wait_until

pytestmark = pytest.mark.slow

ADMITTED = 4  # --max-num-seqs 2 + --max-queue 2
MAX_BODY = 16384
SOAK_REQUESTS = 2000
SOAK_DISCONNECTS = 500
SOAK_CONCURRENCY = 4  # = the admission limit; a dropped connection may hold its slot a moment longer
RSS_MARGIN_BYTES = 200 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    server = TinyServer(
        tiny_model_dir.path, tmp_path_factory.mktemp("soak-server"),
        "--max-num-seqs", "2", "--max-queue", "2", "--max-model-len", "128", "--kv-cache-bytes", "1MiB",
        "--max-body-bytes", str(MAX_BODY), "--request-timeout", "300", "--shutdown-timeout", "120",
    )  # fmt: skip
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def assert_engine_empty(server: TinyServer) -> dict:
    """Wait (generously) until nothing is left in the engine or in flight, and return the stats."""

    def empty() -> dict | None:
        s = server.engine_stats()
        idle = (s["running"], s["waiting"], s["kv_used_blocks"], s["http_in_flight"], s["http_active"])
        return s if idle == (0, 0, 0, 0, 0) else None

    stats = wait_until(empty, 120, "the engine to be empty", interval=0.2)
    assert stats["alive"] and stats["status"] == "ready"
    return stats


def test_overload_burst_is_refused_at_once_and_admitted_requests_complete(server: TinyServer) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True}).encode()
    held = [HeldUpload(server.port, "/v1/completions", body) for _ in range(ADMITTED)]
    try:
        wait_until(lambda: server.engine_stats()["http_in_flight"] == ADMITTED, 60, "the held requests")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        refused = 0
        for i in range(3 * ADMITTED):
            with pytest.raises(openai.RateLimitError) as info:
                if i % 2:
                    client.completions.create(model="tiny", prompt="burst", max_tokens=4, stream=True)
                else:
                    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
            assert info.value.body["code"] == "server_overloaded"
            assert info.value.response.headers["retry-after"] == "1"
            refused += 1
        assert server.engine_stats()["http_refused_total"] >= refused
        assert httpx.get(f"{server.url}/v1/models").status_code == 200, "non-generation routes still answer"
        for upload in held:
            status, payload = upload.finish()
            assert status == 200, payload
            assert json.loads(payload)["choices"][0]["finish_reason"] == "length"
    finally:
        for upload in held:
            upload.close()
    assert_engine_empty(server)


def test_schemathesis_finds_no_server_error(server: TinyServer) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    seen: Counter[int] = Counter()

    def bounded(case) -> None:
        """Keep generation cheap: at most 2 sequences of 4 tokens (the limits themselves are tested above)."""
        if isinstance(case.body, dict):
            if "n" in case.body:
                case.body["n"] = min(abs(case.body["n"]) if isinstance(case.body["n"], int) else 1, 2) or 1
            case.body["max_tokens"] = 4
            case.body["max_output_tokens"] = 4  # /v1/responses
            if case.path.startswith("/api/"):  # Ollama's routes: short answers, and never a pull from the Hub
                options = case.body.get("options")
                case.body["options"] = (options if isinstance(options, dict) else {}) | {"num_predict": 4}
                if case.path == "/api/pull":
                    case.body["model"] = "/nonexistent/model.gguf"

    for operation in operations:

        @settings(max_examples=15, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy())
        def check(case) -> None:
            bounded(case)
            response = case.call(base_url=server.url, timeout=120)
            seen[response.status_code] += 1
            content_type = response.headers.get("content-type", [""])[0]
            streaming = "text/event-stream" in content_type or "application/x-ndjson" in content_type  # SSE, Ollama
            checks = [not_a_server_error] if streaming else [not_a_server_error, response_schema_conformance]
            if response.status_code == 200 and not streaming:
                checks.append(content_type_conformance)
            case.validate_response(response, checks=checks)

        check()
    assert seen[200] > 0 and sum(seen.values()) >= 50, seen
    assert all(status < 500 for status in seen), seen
    assert_engine_empty(server)


# ----------------------------------------------------------------------------- soak


def soak_plan(rng: random.Random) -> list[str]:
    kinds = ["disconnect"] * SOAK_DISCONNECTS
    rest = SOAK_REQUESTS - SOAK_DISCONNECTS
    kinds += rng.choices(["chat", "completion", "stream", "invalid", "oversized", "bad_json"],
                         weights=[30, 25, 20, 10, 10, 5], k=rest)  # fmt: skip
    rng.shuffle(kinds)
    return kinds


async def soak_one(http: httpx.AsyncClient, server: TinyServer, kind: str, rng: random.Random) -> str:
    """Send one request of `kind`; return an outcome label (asserting what must hold for that kind)."""
    tokens = rng.randint(1, 4)
    if kind == "chat":
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code == 429:
            return overloaded(r)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= tokens
        return "ok"
    if kind == "completion":
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": tokens}
        r = await http.post("/v1/completions", json=body)
        if r.status_code == 429:
            return overloaded(r)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return "ok"
    if kind == "stream":
        body = {"model": "tiny", "prompt": "soak", "max_tokens": tokens, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 429:
                await r.aread()
                return overloaded(r)
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"' in lines[-2], lines[-2:]
        return "ok"
    if kind == "invalid":
        body = rng.choice([{"model": "tiny", "messages": []}, {"model": "tiny", "prompt": "x", "temperature": -1},
                           {"model": "tiny", "prompt": [10**9]}, {"prompt": "x", "n": 0}])  # fmt: skip
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await http.post(path, json=body)
        if r.status_code == 429:  # admission comes before the body is read
            return overloaded(r)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        return "rejected"
    if kind == "oversized":
        r = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x" * MAX_BODY, "max_tokens": 1}
        )
        if r.status_code == 429:
            return overloaded(r)
        assert r.status_code == 413, r.text
        return "rejected"
    if kind == "bad_json":
        r = await http.post(
            "/v1/completions", content=b'{"prompt": "x"', headers={"content-type": "application/json"}
        )
        if r.status_code == 429:
            return overloaded(r)
        assert r.status_code == 400, r.text
        return "rejected"
    return await soak_disconnect(server, rng)


def overloaded(r: httpx.Response) -> str:
    """A valid request refused because dropped connections still held their slots: a 429, never a 5xx."""
    assert r.json()["error"]["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
    return "overloaded"


async def soak_disconnect(server: TinyServer, rng: random.Random) -> str:
    """Start a stream (or a non-stream request) and drop the connection at a random point."""
    stream = rng.random() < 0.8
    body = json.dumps({"model": "tiny", "prompt": "bye", "max_tokens": rng.randint(8, 32), "ignore_eos": True,
                       "stream": stream}).encode()  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    await writer.drain()
    for _ in range(rng.randint(0, 6) if stream else 0):  # 0: gone before any byte of the answer
        if not await reader.read(256):
            break
    writer.transport.abort()  # an abrupt close, like a killed client
    return "disconnected"


async def run_soak(server: TinyServer, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    plan = soak_plan(rng)
    outcomes: Counter[str] = Counter()
    sem = asyncio.Semaphore(SOAK_CONCURRENCY)
    limits = httpx.Limits(max_connections=SOAK_CONCURRENCY, max_keepalive_connections=SOAK_CONCURRENCY)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:

        async def one(kind: str, i: int) -> None:
            async with sem:
                outcomes[await soak_one(http, server, kind, random.Random(seed * 100_000 + i))] += 1

        await asyncio.gather(*(one(kind, i) for i, kind in enumerate(plan)))
    return outcomes


def test_soak_leaves_nothing_behind(server: TinyServer) -> None:
    proc = psutil.Process(server.proc.pid)
    asyncio.run(run_soak_warmup(server))
    rss_start = proc.memory_info().rss
    outcomes = asyncio.run(run_soak(server, seed=5))
    assert sum(outcomes.values()) == SOAK_REQUESTS
    assert outcomes["disconnected"] == SOAK_DISCONNECTS
    assert outcomes["ok"] > outcomes["overloaded"], "most valid requests are served"
    assert server.proc.poll() is None, "the server survived"
    stats = assert_engine_empty(server)
    rss_end = proc.memory_info().rss
    print(f"\nsoak: {dict(outcomes)}; RSS {rss_start / 2**20:.0f} MiB -> {rss_end / 2**20:.0f} MiB; "
          f"KV used {stats['kv_used_blocks']}/{stats['kv_total_blocks']} blocks; steps {stats['steps_total']}")  # fmt: skip
    assert rss_end <= rss_start + RSS_MARGIN_BYTES
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 2}
    )
    assert ok.status_code == 200, "the server still serves after the soak"


async def run_soak_warmup(server: TinyServer) -> None:
    """A few requests of each kind first, so RSS is measured after allocator and import warm-up."""
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        for kind in ["chat", "completion", "stream", "invalid", "oversized", "bad_json", "disconnect"] * 5:
            await soak_one(http, server, kind, rng)
    assert_engine_empty(server)


# ----------------------------------------------------------------------------- SIGTERM


def _stream(url: str, results: dict, key: int, started: threading.Event) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    finish, done = None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        results[key] = {"status": r.status_code}
        for line in r.iter_lines():
            started.set()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                finish = choice["finish_reason"] or finish
    results[key] |= {"finish": finish, "done": done}


def test_sigterm_drains_in_flight_streams_and_exits_0(server: TinyServer) -> None:
    """Last in this module: it stops the module's server."""
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3}).encode()
    held = HeldUpload(server.port, "/v1/completions", body)  # in flight until we finish it
    wait_until(lambda: server.engine_stats()["http_in_flight"] == 1, 60, "the held request to be admitted")
    results: dict[int, dict] = {}
    started = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(server.url, results, i, started[i])) for i in range(3)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(120), "a stream did not start"

    os.kill(server.proc.pid, signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{server.url}/ready", timeout=10).status_code == 503, 60, "readiness 503")
    assert httpx.get(f"{server.url}/ready").json()["status"] == "draining"
    assert httpx.get(f"{server.url}/health").status_code == 200, "still alive while draining"
    with pytest.raises(openai.InternalServerError) as info:
        openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60
        ).completions.create(model="tiny", prompt="new", max_tokens=1)
    assert info.value.status_code == 503 and info.value.body["code"] == "server_shutting_down"
    assert server.proc.poll() is None, "the drain waits for the held request"

    status, payload = held.finish()
    assert status == 200 and json.loads(payload)["choices"][0]["finish_reason"] in ("stop", "length")
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(3)] == [{"status": 200, "finish": "length", "done": True}] * 3
    assert server.proc.wait(timeout=120) == 0, server.log_tail()
