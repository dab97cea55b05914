"""Cached npm installs of the CLIs the interop tests run (`@openai/codex`, ...): each package goes into its own
prefix under `~/.cache/peregrine-interop/npm-<name>` (never the server's environment), installed once with the
ordinary `npm`; a rerun reuses it. A lock file makes concurrent test runs wait for one install."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

import pytest

CACHE = Path.home() / ".cache" / "peregrine-interop"


def ensure_npm_tool(package: str, binary: str, timeout_s: float = 900) -> Path:
    """The path of `binary` from `package`, installed first if needed. Skips the test (saying why) when npm is
    missing or the registry cannot be reached; any other install failure fails it."""
    prefix = CACHE / f"npm-{package.strip('@').replace('/', '-')}"
    tool = prefix / "node_modules" / ".bin" / binary
    if tool.exists():
        return tool
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not tool.exists():
            done = subprocess.run([npm, "install", "--prefix", str(prefix), package], capture_output=True,
                                  text=True, timeout=timeout_s)
            if done.returncode != 0:
                unreachable = any(s in done.stderr for s in ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ETIMEDOUT"))
                if unreachable:
                    pytest.skip(f"the npm registry cannot be reached: {done.stderr[-300:]}")
                raise RuntimeError(f"npm install {package} failed: {done.stderr[-2000:]}")
    return tool
