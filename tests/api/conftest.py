"""API tests run against a real server: `python main.py` on a free loopback port, one per test session.

The server serves the default (bundled SmolLM2) model with a small KV cache, from a temporary working
directory (so no developer's `.env` is read) and without any `PEREGRINE_*` variables of the caller's.
Readiness is awaited on `GET /ready` with a generous timeout; the process is stopped by its PID.

`PEREGRINE_TEST_SERVER_URL=http://127.0.0.1:8000` runs the tests against a server you started yourself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support import free_port, server_env, stop_process, wait_http_ok

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 900.0  # loading and dequantizing the GGUF on a busy 2-core machine can take minutes
STOP_TIMEOUT_S = 60.0
SERVER_ARGS = [
    *("--kv-cache-bytes", "256MiB", "--max-model-len", "2048", "--log-level", "info"),
    *("--dtype", "float32"),  # greedy answers as the model was evaluated (bf16 on CPU changes them)
    # Dense, not `auto`: these tests compare answers across requests bit for bit, and `auto` picks by timing. The
    # quantized decoder multiplies int8 activations (as llama.cpp does), so a repeated prompt whose prefix comes
    # from the cache can flip a near-tie greedy pick; tests/engine/test_qdot.py and test_gguf_quantized.py hold
    # it to bounds, and tests/test_clean_clone.py and the use.py tests serve the default.
    *("--weight-format", "dense"),
]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL (server root, no /v1) of a running Peregrine server."""
    external = os.environ.get("PEREGRINE_TEST_SERVER_URL")
    if external:
        wait_http_ok(f"{external.rstrip('/')}/ready", None, Path("/nonexistent"), READY_TIMEOUT_S)
        yield external.rstrip("/")
        return
    workdir = tmp_path_factory.mktemp("server")
    log_path = workdir / "server.log"
    port = free_port()
    env = server_env()
    cmd = [sys.executable, str(REPO / "main.py"), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{base_url}/ready", proc, log_path, READY_TIMEOUT_S)
        yield base_url
    finally:
        stop_process(proc, STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def greedy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second server, for agents' long requests: a 4096-token context, a response store, and greedy sampling
    for requests that send no temperature (`--override-generation-config`; Codex sends none)."""
    workdir = tmp_path_factory.mktemp("greedy-server")
    port, log_path = free_port(), workdir / "server.log"
    args = [a if a != "2048" else "4096" for a in SERVER_ARGS]  # --max-model-len 4096
    args += ["--override-generation-config", '{"temperature": 0}', "--store-path", str(workdir / "store.db")]
    cmd = [sys.executable, str(REPO / "main.py"), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", proc, log_path, READY_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def client(server: str) -> openai.OpenAI:
    """The real OpenAI SDK pointed at the server (no retries, so an error shows as it is)."""
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def model_id(server: str) -> str:
    """The served LLM's id (the list may also hold an embedding model)."""
    data = httpx.get(f"{server}/v1/models", timeout=60).json()["data"]
    return next(m["id"] for m in data if m.get("custom_metadata", {}).get("model_type", "llm") == "llm")


@pytest.fixture(scope="session")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=300) as c:
        yield c
