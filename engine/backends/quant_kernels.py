"""Peregrine's kernels for GGUF weights kept quantized (`csrc/quant.h`, `csrc/quant.cpp`): their own torch
extension, compiled once per ISA level from one source.

- `linear(x, blocks, type)`: x [rows <= 16, K] float32 times the quantized weight's transpose, dequantizing one
  block at a time into L1 (the way llama.cpp's vec_dot kernels read the weights once per step);
- `dequantize(blocks, type, K)`: the rows as float32, for prefill GEMMs (torch's) and embedding lookups.

Variants: `avx512` (the level's flags: AVX2, FMA, F16C and AVX-512 F/BW/VL/BF16/VNNI), `avx2` (-mavx2 -mfma
-mf16c) and `none` (the compiler's baseline, so it builds on any CPU). The one used is the highest this CPU has
under `PEREGRINE_CPU_ISA` (engine/backends/cpu_features.py); tests load each variant the CPU can run. Each is built like
the CPU kernels, by `extension_build.build_extension` (the variant is its ISA level), and cached under
`<cache>/kernels/peregrine_quant_<variant>-<key>/`, keyed by the sources' bytes, torch's version and the flags.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import ModuleType

from engine.backends import cpu_features
from engine.backends.build import build_extension
from engine.backends.cpu_kernels import default_cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
NAME = "peregrine_quant"
SOURCES = ("quant.cpp",)  # and quant.h beside it
_loaded: dict[str, ModuleType | None] = {}
_said: set[str] = set()


def variant(level: str | None = None) -> str:
    """The variant for an ISA level of engine.backends.cpu_features (default: this CPU's, under the ceiling)."""
    level = cpu_features.isa_level() if level is None else level
    if level in ("avx512", "amx"):
        return "avx512"
    return "avx2" if level == "avx2" else "none"


def runnable_variants() -> list[str]:
    """The variants this CPU can run, ignoring the ceiling (tests run each): those of the levels it has, every flag
    of each (the avx512 build multiplies with VNNI, which an AVX-512 CPU such as Skylake-SP lacks)."""
    detected = cpu_features.LEVELS.index(cpu_features.detected_level())
    return list(dict.fromkeys(variant(level) for level in cpu_features.LEVELS[: detected + 1]))


def load(name: str | None = None, cache_dir: Path | None = None) -> ModuleType | None:
    """The compiled module of a variant (default: this CPU's), built on first use; None when it cannot build
    (logged once): callers then dequantize and use torch's matmul."""
    name = variant() if name is None else name
    if name in _loaded:  # per process: the sources do not change under a running server
        return _loaded[name]
    started = time.perf_counter()
    module = None
    try:
        module = build_extension(NAME, [CSRC / s for s in SOURCES], name, cache_dir or default_cache_dir())
        log.info("quantized-weight kernels (%s) ready in %.1f s", name, time.perf_counter() - started)
    except Exception as exc:  # a failed build must not stop the server: dequantize + torch still works
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if reason not in _said:
            _said.add(reason)
            log.warning("quantized-weight kernels off (build failed: %s); dequantizing for torch's matmul", reason)
    _loaded[name] = module
    return module
