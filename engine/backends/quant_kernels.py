"""Peregrine's kernels for GGUF weights kept quantized (`csrc/quant.h`, `csrc/quant.cpp`): their own torch
extension, compiled once per ISA level from one source.

- `linear(x, blocks, type)`: x [rows <= 16, K] float32 times the quantized weight's transpose, dequantizing one
  block at a time into L1 (the way llama.cpp's vec_dot kernels read the weights once per step);
- `dequantize(blocks, type, K)`: the rows as float32, for prefill GEMMs (torch's) and embedding lookups.

Variants: `avx512` (the avx512 level's flags: AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; also the avx512_bf16 and amx
levels' variant), `avx2` (-mavx2 -mfma -mf16c; also avx_vnni's) and `none` (the compiler's baseline, so it builds on
any CPU): this module uses neither VNNI nor BF16. The one used is the highest this CPU has under the configured cap
(`cpu_features.quant_build`, the one ISA map); tests load each variant the CPU can run.
Each is built and loaded like the CPU kernels, through `build.load_extension`, and cached under
`<cache>/kernels/peregrine_quant_<variant>-<key>/`, keyed by the sources' bytes, torch's version and the flags.

The engine never calls `load` from the weights: the CPU backend loads the module (when `--cpu-kernels` is on) and
hands it to the weights (`engine.model.quant.use_kernels`); weights without it use the portable reference.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from engine.backends import cpu_features
from engine.backends.build import load_extension

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
NAME = "peregrine_quant"
SOURCES = ("quant.cpp",)  # and quant.h beside it
_said: set[str] = set()


def variant(level: str | None = None, cap: str = "auto") -> str:
    """The variant for an ISA level of engine.backends.cpu_features (default: this CPU's, under `cap`)."""
    return cpu_features.quant_build(cpu_features.isa_level(cap=cap) if level is None else level)


def runnable_variants() -> list[str]:
    """The variants this CPU can run, ignoring the cap (tests run each): those of the levels it has, every flag
    of each (the avx512 build has VNNI's flag, which an AVX-512 CPU such as Skylake-SP lacks)."""
    return list(dict.fromkeys(variant(level) for level in cpu_features.available_levels()))


def load(cache_dir: Path, name: str | None = None, cap: str = "auto") -> ModuleType | None:
    """The compiled module of a variant (default: this CPU's under `cap`), built on first use into `cache_dir`;
    None when it cannot build (logged once): the weights then dequantize and use torch's matmul."""
    name = variant(cap=cap) if name is None else name
    module, reason = load_extension(NAME, [CSRC / s for s in SOURCES], name, cache_dir)
    if reason is not None and reason not in _said:  # a failed build must not stop the server
        _said.add(reason)
        log.warning("quantized-weight kernels off (%s); dequantizing for torch's matmul", reason)
    return module
