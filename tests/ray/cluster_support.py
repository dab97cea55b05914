"""What tests/ray/test_ray_serve.py uses beside its tests: reading SSE / NDJSON lines, waiting on a condition or
on the replicas, and finding, describing and stopping a private Ray cluster's processes by PID."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, server_env

REPO = Path(__file__).resolve().parents[2]


def next_event(lines: Iterator[str], fmt: str) -> dict:
    for line in lines:
        event = parse(line, fmt)
        if event is not None:
            return event
    raise AssertionError("the stream ended before its first event")


def events(lines: Iterator[str], fmt: str) -> list[dict]:
    return [e for e in (parse(line, fmt) for line in lines) if e is not None]


def parse(line: str, fmt: str) -> dict | None:
    if fmt == "sse":
        if not line.startswith("data: ") or line == "data: [DONE]":
            return None
        line = line.removeprefix("data: ")
    return json.loads(line) if line.strip() else None


def wait_until(check, timeout: float, what: str, fail: bool = True):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (httpx.TransportError, AssertionError):
            value = None
        if value:
            return value
        time.sleep(0.5)
    if fail:
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
    return None


def wait_for_replicas(
    base_url: str, proc: subprocess.Popen, log_path: Path, count: int, timeout: float, wanted: int | None = None
) -> None:
    """Wait until the server itself says `count` of `wanted` (default: `count`) replicas are ready (its log line,
    serving/ray_readiness.py) and `/health` agrees. Serve's RUNNING alone is not the server's word: the proxy
    may not route to a RUNNING replica yet."""
    claim = ready_text(count, wanted or count)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"main.py exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-6000:]}"
            )
        try:
            health = httpx.get(f"{base_url}/health", timeout=10).json()
            running = [r for r in health.get("replicas") or [] if r["state"] == "RUNNING"]
            if len(running) == count and health["replicas_ready"] == claim and said(log_path, claim):
                return
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    pytest.fail(
        f"{claim} not said after {timeout:.0f}s:\n{log_path.read_text(errors='replace')[-6000:]}"
    )


def ready_text(count: int, wanted: int) -> str:
    return f"{count} of {wanted} replicas ready"


def said(log_path: Path, claim: str) -> bool:
    """The driver logged "Peregrine on Ray Serve at URL: <claim>" (its one readiness line per change)."""
    text = log_path.read_text(errors="replace")
    return any("Peregrine on Ray Serve at" in line and f": {claim}" in line for line in text.splitlines())


@dataclass
class RayServer:
    proc: subprocess.Popen
    base_url: str
    ray_tmpdir: str
    log_path: Path


def start_ray_server(model_dir: Path, workdir: Path, args: list[str]) -> RayServer:
    """`main.py` on a private local Ray cluster: its own RAY_TMPDIR (every process it starts inherits it, which
    is how `stop_ray_server` and the shutdown test find them by PID), Ray's single-machine mode (the node binds
    127.0.0.1), no log dedup (each replica's lines are kept), loopback on a free port. `args`: the Ray flags."""
    ray_tmpdir = tempfile.mkdtemp(prefix="prg-ray-", dir="/tmp")  # short: Ray puts unix sockets under it
    log_path = workdir / "server.log"
    port = free_port()
    env = server_env("RAY_")
    env |= {"RAY_TMPDIR": ray_tmpdir, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0",
            "PYTHONPATH": str(REPO)}  # fmt: skip
    cmd = [sys.executable, str(REPO / "main.py"), "--model", str(model_dir), "--device", "cpu",
           "--dtype", "float32", "--embedding-model", "none", "--skip-preflight", "--host", "127.0.0.1",
           "--port", str(port), *args]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return RayServer(proc, f"http://127.0.0.1:{port}", ray_tmpdir, log_path)


def stop_ray_server(server: RayServer) -> None:
    stop(server.proc)
    for pid in cluster_pids(server.ray_tmpdir):  # safety net; test_shutdown_* asserts there were none
        kill(pid)
    shutil.rmtree(server.ray_tmpdir, ignore_errors=True)


def cluster_pids(ray_tmpdir: str) -> list[int]:
    """PIDs of processes whose environment carries this cluster's RAY_TMPDIR (all of Ray's, inherited)."""
    marker = f"RAY_TMPDIR={ray_tmpdir}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ and state != "Z":
            pids.append(int(entry.name))
    return pids


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            out.append(f"{pid}: {cmdline[:120]!r}")
        except OSError:
            pass
    return out


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def stop(proc: subprocess.Popen, stop_timeout_s: float = 90.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=stop_timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
