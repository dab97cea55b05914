"""use.py, the smoke client, passes against a real server (and exits non-zero when it cannot)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

USE_PY = Path(__file__).resolve().parents[2] / "use.py"


def _use(base_url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(USE_PY), "--base-url", base_url, "--max-tokens", "8", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_use_py_passes(server: str) -> None:
    r = _use(server)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and " 0 failed" in r.stdout
    assert "ok   chat stream" in r.stdout and "ok   completions" in r.stdout


def test_use_py_fails_without_a_server() -> None:
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = _use(f"http://127.0.0.1:{port}")
    assert r.returncode != 0 and "FAIL health" in r.stdout
