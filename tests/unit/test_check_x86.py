"""scripts/check_x86.py: every x86 build of the kernels compiles on this machine, whichever of them its CPU runs (an
AVX2-only CPU compiles avx_vnni, avx512 and avx512_bf16 here and runs none), and keeps its promises: the int8 dot
products multiply with AVX-VNNI's `{vex} vpdpbusd` in avx_vnni, AVX-512 VNNI's in avx512 and avx512_bf16, and
`vpmaddubsw` + `vpmaddwd` in avx2. The suite compiles the probe only (vec.h and qdot.h, no torch header beyond c10's
scalar types: seconds a build); `python scripts/check_x86.py --full` compiles every source file too (minutes)."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import pytest

from engine.backends import cpu_features
from engine.backends.build import LEVEL_FLAGS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_x86.py"
_spec = importlib.util.spec_from_file_location("check_x86", SCRIPT)
assert _spec is not None and _spec.loader is not None
check_x86 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_x86)


def _compiler_reason() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return "not an x86 machine"
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        get_cxx_compiler()
    except RuntimeError as exc:
        return f"no C++ compiler ({exc})"
    return None


def test_the_checked_builds_are_every_x86_build() -> None:
    assert set(check_x86.BUILDS) == {b for b in cpu_features.BUILDS.values() if b is not None} == (
        set(LEVEL_FLAGS) - {"neon", "none"})


@pytest.mark.timeout(900)
@pytest.mark.skipif(_compiler_reason() is not None, reason=str(_compiler_reason()))
def test_every_x86_build_compiles_and_multiplies_int8_with_its_own_instructions() -> None:
    assert check_x86.check_probe() == []


def test_the_checks_catch_a_build_breaking_its_promise() -> None:
    """The assembly checks fail loudly: an avx2 build with VNNI, an avx_vnni build with EVEX's vpdpbusd or none,
    an avx512 build without VNNI, bf16 dot products in the int8 kernels."""
    assert check_x86.probe_failures("avx2", "vpmaddubsw %ymm1, %ymm2, %ymm3\n") == []
    assert check_x86.probe_failures("avx2", "vpdpbusd %ymm1, %ymm2, %ymm3\n")
    assert check_x86.probe_failures("avx_vnni", "{vex} vpdpbusd %ymm1, %ymm2, %ymm3\n") == []
    assert check_x86.probe_failures("avx_vnni", "vpdpbusd %ymm1, %ymm2, %ymm3\n")  # EVEX: needs AVX-512 VL
    assert check_x86.probe_failures("avx_vnni", "vpmaddubsw %ymm1, %ymm2, %ymm3\n")  # VNNI unused
    assert check_x86.probe_failures("avx512", "vpdpbusd %zmm1, %zmm2, %zmm3\n") == []
    assert check_x86.probe_failures("avx512", "vpmaddubsw %ymm1, %ymm2, %ymm3\n")
    assert check_x86.probe_failures("avx512", "vpdpbusd %zmm1, %zmm2, %zmm3\nvdpbf16ps %zmm1, %zmm2, %zmm3\n")
