"""use.py, the smoke client, passes against a real server (and exits non-zero when it cannot)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

USE_PY = Path(__file__).resolve().parents[2] / "use.py"
sys.path.insert(0, str(USE_PY.parent))
import use  # noqa: E402  (the smoke client is a script at the repository root)


def _use(base_url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(USE_PY), "--base-url", base_url, "--max-tokens", "8", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_use_py_passes(server: str) -> None:
    r = _use(server)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and f"{len(use.CHECKS)} passed, 0 failed" in r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith("ok   ")]
    assert len(lines) == len(use.CHECKS)  # one line per route
    for name, _ in use.CHECKS:
        assert any(line.startswith(f"ok   {name} (") for line in lines), name
    names = " | ".join(name for name, _ in use.CHECKS)
    for route in ("embeddings", "tokenize", "legacy chat_completion SSE", "legacy chat_completion NDJSON",
                  "legacy completion SSE", "legacy completion NDJSON", "/v1/health", "/v1/version",
                  "/v1/providers", "models/{id}", "chat stream", "completions stream", "chat json_schema",
                  "chat tool call", "chat tool call stream", "anthropic messages", "anthropic messages stream",
                  "anthropic count_tokens"):
        assert route in names, route


def test_one_failing_check_is_reported_and_the_rest_still_run(capsys: pytest.CaptureFixture) -> None:
    def broken(ctx: object) -> str:
        raise AssertionError("the route answered 500")

    checks = [("first", lambda ctx: "fine"), ("broken", broken), ("last", lambda ctx: "fine too")]
    assert use.run(use.Ctx("http://x", None, 1, None, None), checks) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok   first") and out[1] == "FAIL broken: AssertionError: the route answered 500"
    assert out[2].startswith("ok   last") and out[3] == "2 passed, 1 failed"


def test_use_py_fails_without_a_server() -> None:
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = _use(f"http://127.0.0.1:{port}")
    assert r.returncode != 0 and "FAIL health" in r.stdout
