"""A real Peregrine server (`python main.py`) on the tiny random model, for the hardening tests.

The tiny model (2 layers, hidden 64, built by `tests/conftest.py`) makes a request cost milliseconds, so
the soak and overload tests can send thousands. Each server runs from a temporary working directory (no
`.env`), without the caller's `PEREGRINE_*` variables, on a free loopback port; it is stopped by its PID.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, log_tail, server_env, stop_process, wait_http_ok

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
BASE_ARGS = ["--device", "cpu", "--dtype", "float32", "--embedding-model", "none", "--skip-preflight",
             "--served-model-name", "tiny",
             "--log-level", "warning"]  # fmt: skip


class TinyServer:
    def __init__(self, model_dir: Path, workdir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        env = server_env()
        cmd = [sys.executable, str(REPO / "main.py"), "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), *BASE_ARGS, *args]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, chars: int = 6000) -> str:
        return log_tail(self.log_path, chars)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        wait_http_ok(f"{self.url}/ready", self.proc, self.log_path, timeout, interval=0.5)

    def engine_stats(self) -> dict:
        return httpx.get(f"{self.url}/health/engine", timeout=30).json()

    def stop(self) -> None:
        stop_process(self.proc, STOP_TIMEOUT_S)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it returns a truthy value (returned); fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


class HeldUpload:
    """A generation request whose headers are sent but whose body is held back.

    The server admits a generation request when its headers arrive, so this holds one admission slot,
    deterministically, until `finish()` sends the rest of the body (and returns the HTTP status and body).
    """

    def __init__(self, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.body = body
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")  # fmt: skip
        self.sock.sendall(head.encode() + body[:1])

    def finish(self) -> tuple[int, bytes]:
        self.sock.sendall(self.body[1:])
        return self.read()

    def read(self) -> tuple[int, bytes]:
        chunks = []
        while chunk := self.sock.recv(65536):
            chunks.append(chunk)
        self.sock.close()
        raw = b"".join(chunks)
        head, _, payload = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            payload = _dechunk(payload)
        return status, payload

    def close(self) -> None:
        self.sock.close()


def _dechunk(data: bytes) -> bytes:
    out, rest = [], data
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)
