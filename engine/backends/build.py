"""Building and loading Peregrine's C++ extensions: one compiled module per ISA level, cached, one guard around each
build, and the one loader (`load_extension`) that both the CPU kernels (engine/backends/cpu_kernels.py) and the
quantized-weight kernels (engine/backends/quant_kernels.py) go through.

`load_extension(name, sources, level, cache_dir)` gives the module, built on first use, or None with the reason
when it cannot build (the caller logs it once and keeps torch's ops). One module per name, level and source set in
a process, wherever it was built: pybind11 refuses to register the same classes twice, so another cache folder
reuses the module already loaded; a failed build is not retried in the same process.

`build_extension(name, sources, level, cache_dir)` compiles `sources` with torch's extension builder
(`torch.utils.cpp_extension.load`) and the flags of `level` (`LEVEL_FLAGS`), into
`<cache>/kernels/<name>_<level>-<key>/`, where the key hashes the torch version, the flags and the bytes of every
source and of the headers beside them, and nothing else. torch's builder rebuilds a folder when it sees its
sources at another path, so the sources and headers are first copied into the build folder (`src/`) and built
from there. Once a build has finished (a marker file says so), later processes import the library directly,
without torch's builder, whose ninja file names the venv's include folders: a clone, a worktree or an installed
copy with the same sources and its own venv loads the module another one built, in milliseconds. Each level gets
its own module name (`<name>_<level>`), so one process can hold two levels (tests run the AVX2 path on AVX-512
machines).

torch's builder serialises builds of one folder with a `lock` file it creates and deletes; a builder killed
mid-build (a server stopped while it compiled, a test timed out) leaves that file behind, and every later start
then waits on it forever. Builds here take an `flock` first, which the kernel drops when its holder dies, so
while it is held no other builder can be running in that folder and a `lock` file found there is stale.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

TORCH_LOCK = "lock"  # torch.utils.file_baton's file in the build directory
BUILT = ".peregrine-built"  # written once the library is whole

# The compiler flags of each build the kernels are built for (engine.backends.cpu_features names the x86 levels and
# maps them to these builds; NEON is part of every aarch64 CPU, so it needs no flag). "none" is the compiler's
# baseline, for code that has a portable path (the quantized-weight kernels); which builds a module is built for is
# its caller's choice. Each x86 build's flags are its level's CPU flags (cpu_features.needs), so a build runs no
# instruction its level does not promise, except AMX's in avx512_bf16, whose tiles are used only where the CPU
# says it has them (amx.cpp and qdot_lanes.h ask at run time). (GCC's -mavx512f implies neither FMA nor F16C.)
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
LEVEL_FLAGS: dict[str, list[str]] = {
    "avx512_bf16": [*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],  # AMX: at run time
    "avx512": _AVX512,
    "avx_vnni": [*_AVX2, "-mavxvnni"],
    "avx2": _AVX2,
    "neon": [],
    "none": [],
}
BASE_FLAGS = ["-O3", "-fopenmp"]


@contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's flock for the block, after clearing a stale torch lock left by a dead builder."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".peregrine-build.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits while another live process builds here
        try:
            stale = build_dir / TORCH_LOCK
            if stale.exists():
                log.warning("removing %s, left by a build that was stopped midway", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def level_flags(level: str) -> list[str]:
    """The full compiler flags of `level` (one of LEVEL_FLAGS)."""
    if level not in LEVEL_FLAGS:
        raise ValueError(f"unknown ISA level {level!r}: expected one of {', '.join(LEVEL_FLAGS)}")
    return [*BASE_FLAGS, *LEVEL_FLAGS[level]]


def build_inputs(sources: Sequence[Path]) -> list[Path]:
    """What a build reads: the sources and every header in their folders."""
    folders = {Path(s).parent for s in sources}
    headers = [h for folder in sorted(folders) for h in sorted(folder.glob("*.h"))]
    return sorted({*map(Path, sources), *headers})


def build_key(sources: Sequence[Path], flags: Sequence[str]) -> str:
    """What the build depends on: torch's version, the flags, and the name and bytes of each source and header
    beside them; not where they are (the build reads copies, `build_extension`)."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(flags).encode())
    for path in build_inputs(sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def stage_sources(sources: Sequence[Path], folder: Path) -> list[Path]:
    """Copies of `sources` and their headers in `folder` (made once: the folder is keyed by their bytes, and an
    unchanged file keeps its time stamp, so ninja keeps the objects built from it); the copied sources' paths."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in build_inputs(sources):
        copy = folder / path.name
        if not copy.exists() or copy.read_bytes() != path.read_bytes():
            partial = copy.with_name(f".{copy.name}.{os.getpid()}")
            partial.write_bytes(path.read_bytes())
            partial.replace(copy)  # a copy is whole or absent, even when its writer is killed
    return [folder / Path(s).name for s in sources]


def build_extension(name: str, sources: Sequence[Path], level: str, cache_dir: Path,
                    extra_flags: Sequence[str] = ()) -> ModuleType:
    """The module `<name>_<level>` compiled from `sources` with `level`'s flags (and `extra_flags`), built once
    into `cache_dir/kernels` and loaded from there afterwards, wherever the sources live. Raises what the build
    raises (the caller decides what a failure means)."""
    flags = [*level_flags(level), *extra_flags]
    module_name = f"{name}_{level}"
    build_dir = cache_dir / "kernels" / f"{module_name}-{build_key(sources, flags)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    library, built = build_dir / f"{module_name}.so", build_dir / BUILT
    with exclusive_build(build_dir):
        if library.exists() and built.exists():
            # Built before, from these very bytes and flags (the key says so): import it as it is. torch's builder
            # would compare its ninja file, which names this venv's include folders, and so recompile in every
            # fresh clone with its own venv.
            module = import_library(module_name, library)
        else:
            log.info("compiling %s for %s into %s, once", name, level, build_dir)
            from torch.utils.cpp_extension import load

            staged = stage_sources(sources, build_dir / "src")
            module = load(name=module_name, sources=[str(p) for p in staged], extra_cflags=flags,
                          extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
            built.touch()  # the library is whole: only now may a later process import it without the builder
    log.debug("%s (%s) ready in %.1f s", name, level, time.perf_counter() - started)
    return module


_loaded: dict[tuple[str, str, str], ModuleType | None] = {}  # (name, level, build key) -> module; None: failed
_failures: dict[tuple[str, str, str], str] = {}  # why each failed build failed


def load_extension(name: str, sources: Sequence[Path], level: str,
                   cache_dir: Path) -> tuple[ModuleType | None, str | None]:
    """(the module `<name>_<level>`, None) built once into `cache_dir/kernels`, or (None, why) when the build fails:
    a failed build must never stop the server, the caller falls back to torch's ops."""
    key = (name, level, build_key(sources, level_flags(level)))
    if key in _loaded:
        module = _loaded[key]
        return (module, None) if module is not None else (None, _failures[key])
    try:
        module, reason = build_extension(name, sources, level, cache_dir), None
    except Exception as exc:
        text = str(exc).strip()
        module, reason = None, f"build failed: {text.splitlines()[-1] if text else type(exc).__name__}"
        _failures[key] = reason
    _loaded[key] = module
    return module, reason


def forget_failures() -> None:
    """Let failed builds be tried again (tests that repair a build folder)."""
    for key in [k for k, module in _loaded.items() if module is None]:
        del _loaded[key]


def import_library(module_name: str, library: Path) -> ModuleType:
    """The compiled extension module at `library` (torch is imported first: the module links against it)."""
    spec = importlib.util.spec_from_file_location(module_name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {module_name} from {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
