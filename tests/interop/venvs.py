"""Build and cache the third-party virtual environments the interop tests run in.

Each environment is keyed by its Python version and requirement set, built once from the package registry
with the ordinary `pip`, and kept under `<cache>/interop-venvs/<name>-<key>/` (`<cache>`: Peregrine's cache dir,
`config.tool_cache_dir()`, ~/.cache/peregrine by default; `PEREGRINE_INTEROP_VENVS` names another folder), so a
rerun reuses it, from any checkout (CI runs in a fresh clone, which would otherwise build all four again, minutes
of pip on 2 cores). A build that fails leaves no half-made venv behind (it is built in a temporary folder and renamed).

Run as a script to build them ahead of the tests: `python -m tests.interop.venvs [name ...]`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from config import tool_cache_dir

CACHE = Path(os.environ.get("PEREGRINE_INTEROP_VENVS") or tool_cache_dir() / "interop-venvs")
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv")))


@dataclass(frozen=True)
class VenvSpec:
    name: str
    python: str  # "3.11" or "3.12": the interpreter minor version
    requirements: tuple[str, ...]

    @property
    def key(self) -> str:
        text = self.python + "\n" + "\n".join(sorted(self.requirements))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def path(self) -> Path:
        return CACHE / f"{self.name}-{self.key}"

    def bin(self, tool: str) -> Path:
        return self.path / "bin" / tool


# llama-stack-client 0.7.x needs Python >= 3.12.
CLIENT_MODERN = VenvSpec("lsc-0.7", "3.12", ("llama-stack-client>=0.7,<0.8",))
# The last client that crashes on `data: [DONE]` (JSONDecodeError): the [DONE] rule spares it.
CLIENT_NO_DONE = VenvSpec("lsc-0.6.0", "3.12", ("llama-stack-client==0.6.0",))
# The last client with the native /v1/inference/* API; it imports `fire` and `requests` without declaring them.
CLIENT_LEGACY = VenvSpec("lsc-0.2", "3.11", ("llama-stack-client==0.2.12", "fire", "requests"))
# A real Llama Stack server. Newer mcp and openai releases break its CLI and its OpenAI passthrough. The same
# venv runs Llama Stack's own integration tests (`llama_stack_tests`: their conftest imports llama_stack, its client
# and ollama; pytest 9 refuses their `pytest_ignore_collect(path)` hook), so the version is the tests' one.
LLAMA_STACK_VERSION = "0.7.3"
SERVER = VenvSpec(
    "llama-stack-0.7",
    "3.12",
    (f"llama-stack=={LLAMA_STACK_VERSION}", "mcp==1.25.0", "openai==2.5.0", "llama-stack-client>=0.7,<0.8",
     "ollama", "pytest>=8.4,<9"),
)
SPECS = {spec.name: spec for spec in (CLIENT_MODERN, CLIENT_NO_DONE, CLIENT_LEGACY, SERVER)}


def find_python(minor: str) -> str | None:
    """An interpreter for `minor` ("3.12"): on PATH, or under pyenv's versions folder."""
    found = shutil.which(f"python{minor}")
    if found and _runs(found):
        return found
    versions = sorted(PYENV_ROOT.glob(f"versions/{minor}.*/bin/python{minor}"), reverse=True)
    return next((str(p) for p in versions if _runs(str(p))), None)


def _runs(python: str) -> bool:
    return subprocess.run([python, "-c", "import venv"], capture_output=True).returncode == 0


def ensure_venv(spec: VenvSpec, timeout_s: float = 3000) -> Path:
    """Return the venv folder for `spec`, building it first if the cache has none. Raises on failure.
    A lock file makes concurrent callers (two test runs) wait for one build instead of racing."""
    if (spec.path / ".complete").exists():
        return spec.path
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (spec.path / ".complete").exists():
            _build(spec, timeout_s)
    return spec.path


def _build(spec: VenvSpec, timeout_s: float) -> None:
    python = find_python(spec.python)
    if python is None:
        raise RuntimeError(f"no Python {spec.python} interpreter found (PATH or {PYENV_ROOT}/versions)")
    tmp = spec.path.with_name(spec.path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(tmp)], check=True, timeout=300)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *spec.requirements], check=True, timeout=timeout_s)
    shutil.rmtree(spec.path, ignore_errors=True)
    tmp.rename(spec.path)  # venv scripts use their own folder's path via `bin/python`, which we always call
    _fix_shebangs(tmp, spec.path)
    (spec.path / ".complete").write_text("\n".join(spec.requirements) + "\n")


def _fix_shebangs(old: Path, new: Path) -> None:
    """Console scripts carry the absolute interpreter path of the folder they were installed in."""
    for script in (new / "bin").iterdir():
        if not script.is_file() or script.is_symlink():
            continue
        try:
            text = script.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if text.startswith("#!") and str(old) in text:
            script.write_text(text.replace(str(old), str(new)))
    cfg = new / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace(str(old), str(new)))


def llama_stack_tests() -> Path:
    """The source tree of Llama Stack LLAMA_STACK_VERSION (its sdist, which holds `tests/integration`), from the
    package registry once, kept beside the venvs; its tests run in SERVER's venv."""
    root = CACHE / f"llama_stack-{LLAMA_STACK_VERSION}"
    if (root / ".complete").exists():
        return root
    venv = ensure_venv(SERVER)
    with open(CACHE / "llama-stack-sources.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            download = CACHE / "llama-stack-sdist"
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "download", "-q", "--disable-pip-version-check",
                            "--no-deps", "--no-binary", ":all:", f"llama-stack=={LLAMA_STACK_VERSION}", "-d",
                            str(download)], check=True, timeout=600)  # fmt: skip
            sdist = download / f"llama_stack-{LLAMA_STACK_VERSION}.tar.gz"
            subprocess.run(["tar", "xzf", str(sdist), "-C", str(CACHE)], check=True, timeout=600)
            (root / ".complete").write_text(f"{sdist.name}\n")
    return root


def main(names: list[str]) -> int:
    for name in names or list(SPECS):
        path = ensure_venv(SPECS[name])
        print(f"{name}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
