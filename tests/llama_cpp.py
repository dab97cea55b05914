"""llama.cpp's `llama-server`, the peer some tests agree with: built natively from the llama.cpp that
llama-cpp-python's sdist vendors (fetched from the package registry, no other download), static, once per machine,
under ~/.cache/peregrine (or $PEREGRINE_LLAMA_CPP_CACHE). The first build takes several minutes on two cores; a
machine without cmake, ninja or a C++ compiler skips the tests that need it, saying so."""

from __future__ import annotations

import fcntl
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench_peers():  # noqa: ANN202 - the scripts/ module
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench_peers
    finally:
        sys.path.pop(0)
    return bench_peers


CACHE = _bench_peers().SUITE_LLAMA_CPP  # the benchmarks' llama-server falls back on this build too


def source() -> Path:
    """The unpacked sdist (vendor/llama.cpp inside: its models/ggml-vocab-*.gguf and templates)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _bench_peers().llama_cpp_source(CACHE / "sdist")


def llama_server() -> Path:
    """The llama-server binary, built first if this machine has none yet."""
    binary = CACHE / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    missing = [tool for tool in ("cmake", "ninja", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"building llama-server needs {', '.join(missing)}")
    src = source()
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.is_file():
            _bench_peers().build_llama_cpp(src, CACHE / "build", shared=False)
    return binary


def server_flags() -> list[str]:
    """The flags this build needs on this CPU: `--no-repack` where the CPU has AMX, whose kernels the native build
    compiles and which crash in `llama_decode` (checked on an Intel Xeon with AMX, 2026-12-01: SIGSEGV without it)."""
    return _bench_peers().native_flags()
