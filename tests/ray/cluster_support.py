"""What tests/ray/test_ray_serve.py uses beside its tests: reading SSE / NDJSON lines, waiting on a condition or
on the replicas, and finding, describing and stopping a private Ray cluster's processes by PID."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


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
    base_url: str, proc: subprocess.Popen, log_path: Path, count: int, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"main.py exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-6000:]}"
            )
        try:
            health = httpx.get(f"{base_url}/health", timeout=10).json()
            running = [r for r in health.get("replicas") or [] if r["state"] == "RUNNING"]
            if len(running) == count:
                return
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    pytest.fail(
        f"{count} replicas not running after {timeout:.0f}s:\n{log_path.read_text(errors='replace')[-6000:]}"
    )


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
