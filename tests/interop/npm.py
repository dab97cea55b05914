"""Install and cache the npm packages the interop tests run (CLIs such as Claude Code), never into the server's venv.

Each package set is installed once with the ordinary `npm install --prefix`, into
`~/.cache/peregrine-interop/npm/<name>-<key>/` (`PEREGRINE_INTEROP_NPM` names another folder; the key hashes the
package specs), built in a temporary folder and renamed, under a file lock, so a failed install leaves nothing
half-made and parallel sessions install once. When the registry cannot be reached the caller skips with the reason.

Run as a script to install ahead of the tests: `python -m tests.interop.npm`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("PEREGRINE_INTEROP_NPM") or Path.home() / ".cache" / "peregrine-interop" / "npm")
INSTALL_TIMEOUT_S = 900.0
_OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ETIMEDOUT", "ECONNRESET", "network", "proxy")


class RegistryUnreachable(RuntimeError):
    """npm could not reach its registry: the tests that need the package skip, naming this."""


@dataclass(frozen=True)
class NpmSpec:
    name: str
    packages: tuple[str, ...]

    @property
    def path(self) -> Path:
        key = hashlib.sha256("\n".join(sorted(self.packages)).encode()).hexdigest()[:12]
        return CACHE / f"{self.name}-{key}"

    def bin(self, tool: str) -> Path:
        return self.path / "node_modules" / ".bin" / tool


CLAUDE_CODE = NpmSpec("claude-code", ("@anthropic-ai/claude-code@2",))
CODEX = NpmSpec("codex", ("@openai/codex",))
SPECS = {spec.name: spec for spec in (CLAUDE_CODE, CODEX)}


def ensure(spec: NpmSpec, tool: str) -> Path:
    """The path of `tool` from `spec`'s install, installing it on first use."""
    if spec.bin(tool).exists():
        return spec.bin(tool)
    npm = shutil.which("npm")
    if npm is None:
        raise RegistryUnreachable("npm is not installed")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not spec.bin(tool).exists():
            _install(npm, spec)
    return spec.bin(tool)


def _install(npm: str, spec: NpmSpec) -> None:
    building = spec.path.with_name(spec.path.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    cmd = [npm, "install", "--prefix", str(building), "--no-audit", "--no-fund", *spec.packages]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(building, ignore_errors=True)
        raise RegistryUnreachable(f"npm install {' '.join(spec.packages)} timed out") from exc
    if done.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        tail = done.stderr[-2000:]
        if any(word in tail for word in _OFFLINE):
            raise RegistryUnreachable(f"npm install {' '.join(spec.packages)} could not reach the registry: {tail}")
        raise RuntimeError(f"npm install {' '.join(spec.packages)} failed:\n{tail}")
    building.rename(spec.path)


def ensure_npm_tool(package: str, binary: str) -> Path:
    """`binary` from the one-package install of `package` (a known spec, or one made for it); a pytest skip naming
    the reason when the registry cannot be reached."""
    import pytest

    spec = next((s for s in SPECS.values() if s.packages == (package,)), NpmSpec(package.strip("@").replace("/", "-"),
                                                                                  (package,)))
    try:
        return ensure(spec, binary)
    except RegistryUnreachable as exc:
        pytest.skip(str(exc))


if __name__ == "__main__":
    for npm_spec, tool in ((CLAUDE_CODE, "claude"), (CODEX, "codex")):
        print(ensure(npm_spec, tool))
