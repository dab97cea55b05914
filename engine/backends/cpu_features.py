"""What this CPU offers Peregrine's kernels: the one probe of its features, and the one ceiling on them.

The kernels come in ISA levels, named by what their code uses, each with its own full set of CPU flags:

- `avx2`: AVX2 + FMA + F16C, what nearly every x86-64 CPU of the last decade has (AMD Zen 1-3, Intel client
  CPUs, Skylake-SP Xeons, most cloud VMs); the int8 dot products in `vpmaddubsw` + `vpmaddwd`;
- `avx_vnni`: that and AVX-VNNI, the int8 dot products in one 256-bit `vpdpbusd` (Intel Alder Lake and later
  client CPUs, Sierra Forest, Sapphire Rapids+; AMD Zen 5);
- `avx512`: AVX-512 F/BW/VL with VNNI: 16-lane vectors and 512-bit int8 dot products, no BF16 (Intel Cascade
  Lake, Ice Lake; everything after it too);
- `avx512_bf16`: that and AVX512-BF16, the bf16 dot products (`vdpbf16ps`) of the bf16 linear (AMD Zen 4+,
  Intel Cooper Lake, Sapphire Rapids+);
- `amx`: AMX tiles on top of that, for the decoder's bf16 matmuls and (with AMX-INT8) its steps of 9 rows and more on
  tiled Q4_0 / Q4_1 / Q8_0 weights (Intel Sapphire Rapids and later).

They are ordered as listed (LEVELS), each one's kernels doing at least what the one before does, but they are no
chain of flags: Ice Lake has AVX-512 VNNI and no AVX-VNNI, Alder Lake the reverse. The CPU's level is the highest
whose flags it has every one of.

`EngineConfig.cpu_isa` (the `--cpu-isa` flag, or `PEREGRINE_CPU_ISA` in the environment, read by config like
oneDNN's `ONEDNN_MAX_CPU_ISA`) caps the level the kernels may use: `auto` (no cap) or a level; the kernels then
use the highest level at or below the cap that the CPU has. So `avx512` on a CPU with AVX512-BF16 or AMX runs
the 512-bit int8 kernels without the bf16 dot products or the tiles, and `avx_vnni` on an AVX-512 CPU without
AVX-VNNI (Ice Lake, Zen 4) runs `avx2`. The cap is passed down (config -> EngineConfig -> the CPU backend ->
here), never read from the environment here; Ray replicas get it inside their EngineConfig. One machine can so
run the paths of a smaller CPU: CI runs every level its CPU has this way.

This module is also the one map from an ISA level to the builds of the C++ extensions (`kernel_build`,
`quant_build`) and the one AMX decision (`amx`).
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

ENV = "PEREGRINE_CPU_ISA"  # config reads it into Settings.cpu_isa; named here for messages
# Ascending: each level's kernels do at least what the one before does. Not a chain of flags (`_NEEDS`).
LEVELS = ("none", "avx2", "avx_vnni", "avx512", "avx512_bf16", "amx")
CHOICES = ("auto", *LEVELS)
_AVX2 = ("avx2", "fma", "f16c")  # Linux's /proc/cpuinfo flag names
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # (GCC's -mavx512f implies no FMA or F16C)
_NEEDS: dict[str, tuple[str, ...]] = {  # every flag a level's build may use
    "none": (),
    "avx2": _AVX2,
    "avx_vnni": (*_AVX2, "avx_vnni"),
    "avx512": _AVX512,
    "avx512_bf16": (*_AVX512, "avx512_bf16"),
    "amx": (*_AVX512, "avx512_bf16", "amx_tile", "amx_bf16"),
}


def _cpuinfo_field(cpuinfo: Path, keys: tuple[str, ...]) -> str | None:
    """The value of the first /proc/cpuinfo line whose key is one of `keys`; None where there is none or no file."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value
    return None


@cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where there is no /proc/cpuinfo)."""
    value = _cpuinfo_field(cpuinfo, ("flags", "Features"))  # x86 / aarch64
    return frozenset() if value is None else frozenset(value.split())


@cache
def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as Linux reports it ("AMD EPYC", "Intel(R) Xeon(R) ..."); "" where there is none."""
    value = _cpuinfo_field(cpuinfo, ("model name",))
    return "" if value is None else value.strip()


@cache
def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The x86 vendor string Linux reports ("AuthenticAMD", "GenuineIntel"); "" elsewhere."""
    value = _cpuinfo_field(cpuinfo, ("vendor_id",))
    return "" if value is None else value.strip()


def needs(level: str) -> tuple[str, ...]:
    """Every CPU flag (as /proc/cpuinfo names it) that `level`'s kernels may use."""
    return _NEEDS[level]


def available_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU can run, ascending: those whose flags it has every one of ("none" always)."""
    flags = cpu_flags() if flags is None else flags
    return [level for level in LEVELS if all(flag in flags for flag in _NEEDS[level])]


def detected_level(flags: frozenset[str] | None = None) -> str:
    """The highest level whose flags this CPU has, every one of them."""
    return available_levels(flags)[-1]


def ceiling(value: str = "auto") -> str:
    """The cap `value` names (EngineConfig.cpu_isa), checked. Unknown values raise ValueError."""
    value = value.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def isa_level(flags: frozenset[str] | None = None, cap: str = "auto") -> str:
    """The level the kernels use: the highest the CPU has at or below the ceiling."""
    have, limit = available_levels(flags), ceiling(cap)
    if limit == "auto":
        return have[-1]
    return [level for level in have if LEVELS.index(level) <= LEVELS.index(limit)][-1]


def has(level: str, flags: frozenset[str] | None = None, cap: str = "auto") -> bool:
    """Whether the kernels here run at `level` (one of LEVELS) or a higher one: do at least what it does."""
    return LEVELS.index(isa_level(flags, cap)) >= LEVELS.index(level)


# The one map from an ISA level to a build of Peregrine's C++ extensions (engine.backends.build.LEVEL_FLAGS).
# AMX is picked at run time inside the avx512_bf16 build, so it needs no build of its own.
BUILDS: dict[str, str | None] = {"none": None, "avx2": "avx2", "avx_vnni": "avx_vnni", "avx512": "avx512",
                                 "avx512_bf16": "avx512_bf16", "amx": "avx512_bf16"}
# The quantized-weight kernels (quant.cpp) use AVX2 or AVX-512 F/BW vectors and neither VNNI nor BF16: the levels
# that add only those share the build below them (one build fewer to compile).
QUANT_BUILDS: dict[str, str] = {"none": "none", "avx2": "avx2", "avx_vnni": "avx2", "avx512": "avx512",
                                "avx512_bf16": "avx512", "amx": "avx512"}


def kernel_build(cap: str = "auto", flags: frozenset[str] | None = None) -> str | None:
    """The build of the CPU kernels (engine.backends.cpu_kernels) for this CPU under `cap`: one of BUILDS' builds
    or "neon" (every aarch64 CPU has it); None where there is none."""
    build = BUILDS[isa_level(flags, cap)]
    if build is None and platform.machine() in ("aarch64", "arm64") and ceiling(cap) != "none":
        return "neon"
    return build


def quant_build(level: str) -> str:
    """The build of the quantized-weight kernels (engine.backends.quant_kernels) for an ISA level: "avx512",
    "avx2" or "none" (the compiler's baseline: that module has a portable path)."""
    return QUANT_BUILDS[level]


def amx(cap: str = "auto", flags: frozenset[str] | None = None) -> bool:
    """The one AMX decision: whether bf16 matmuls may run on AMX tiles here (the CPU has AMX-BF16 and the cap
    allows it). The decoder keeps a packed copy of the weights for them, which the preflight counts."""
    return has("amx", flags, cap)
