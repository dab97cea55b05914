"""Peregrine's kernels for GGUF weights kept quantized (`csrc/quant.h`, `csrc/quant.cpp`): their own torch
extension, compiled once per ISA level from one source.

- `linear(x, blocks, type)`: x [rows <= 16, K] float32 times the quantized weight's transpose, dequantizing one
  block at a time into L1 (the way llama.cpp's vec_dot kernels read the weights once per step);
- `dequantize(blocks, type, K)`: the rows as float32, for prefill GEMMs (torch's) and embedding lookups.

Variants: `avx512` (-mavx512f/bw/vl), `avx2` (-mavx2 -mfma -mf16c) and `none` (the compiler's baseline, so it
builds on any CPU). The one used is the highest this CPU has under `PEREGRINE_CPU_ISA` (engine/cpu_features.py);
tests load each variant the CPU can run. Each build is cached under `<cache>/quant-kernels/<variant>-<key>/`,
keyed by the sources, torch's version and the flags, and guarded by `extension_build.exclusive_build`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from types import ModuleType

import torch

from engine import cpu_features
from engine.cpu_kernels import default_cache_dir
from engine.extension_build import exclusive_build

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("quant.cpp",)
HEADERS = ("quant.h",)
FLAGS = {  # per variant, on top of -O3 -fopenmp
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "none": [],
}
_loaded: dict[str, ModuleType | None] = {}
_said: set[str] = set()


def variant(level: str | None = None) -> str:
    """The variant for an ISA level of engine.cpu_features (default: this CPU's, under the ceiling)."""
    level = cpu_features.isa_level() if level is None else level
    if level in ("avx512", "amx"):
        return "avx512"
    return "avx2" if level == "avx2" else "none"


def runnable_variants() -> list[str]:
    """The variants this CPU can run, ignoring the ceiling (tests run each)."""
    flags = cpu_features.cpu_flags()
    found = ["none"]
    if all(f in flags for f in ("avx2", "fma", "f16c")):
        found.append("avx2")
        if all(f in flags for f in ("avx512f", "avx512bw", "avx512vl")):
            found.append("avx512")
    return found


def build_key(name: str) -> str:
    digest = hashlib.sha256(f"{torch.__version__} {' '.join(FLAGS[name])}".encode())
    for file in (*SOURCES, *HEADERS):
        path = CSRC / file
        digest.update(str(path.resolve()).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def load(name: str | None = None, cache_dir: Path | None = None) -> ModuleType | None:
    """The compiled module of a variant (default: this CPU's), built on first use; None when it cannot build
    (logged once): callers then dequantize and use torch's matmul."""
    name = variant() if name is None else name
    if name in _loaded:  # per process: the sources do not change under a running server
        return _loaded[name]
    key = build_key(name)
    build_dir = (cache_dir or default_cache_dir()) / "quant-kernels" / f"{name}-{key}"
    module_name = f"peregrine_quant_{name}"
    started = time.perf_counter()
    if not (build_dir / f"{module_name}.so").exists():
        log.info("compiling Peregrine's quantized-weight kernels (%s) into %s, once", name, build_dir)
    module = None
    try:
        from torch.utils.cpp_extension import load as build

        with exclusive_build(build_dir):
            module = build(name=module_name, sources=[str(CSRC / s) for s in SOURCES],
                           extra_cflags=["-O3", "-fopenmp", *FLAGS[name]], extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), verbose=False)
        log.info("quantized-weight kernels (%s) ready in %.1f s", name, time.perf_counter() - started)
    except Exception as exc:  # a failed build must not stop the server: dequantize + torch still works
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if reason not in _said:
            _said.add(reason)
            log.warning("quantized-weight kernels off (build failed: %s); dequantizing for torch's matmul", reason)
    _loaded[name] = module
    return module
