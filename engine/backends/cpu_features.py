"""What this CPU offers Peregrine's kernels: the one probe of its features, and the one ceiling on them.

The kernels come in ISA levels, each a superset of the one before:

- `avx2`: AVX2 + FMA + F16C, what nearly every x86-64 CPU of the last decade has (AMD Zen 1-3, Intel client
  CPUs, most cloud VMs);
- `avx512`: AVX-512 F/BW/VL with the BF16 and VNNI dot products (AMD Zen 4+, Intel Cooper Lake / Sapphire
  Rapids+: every CPU with AVX512-BF16 has VNNI);
- `amx`: AMX-BF16 tiles on top of that (Intel Sapphire Rapids and later).

`EngineConfig.cpu_isa` (the `--cpu-isa` flag, or `PEREGRINE_CPU_ISA` in the environment, read by config like
oneDNN's `ONEDNN_MAX_CPU_ISA`) caps the level the kernels may use: `auto` (no cap), `amx`, `avx512`, `avx2` or
`none`. The cap is passed down (config -> EngineConfig -> the CPU backend -> here), never read from the
environment here; Ray replicas get it inside their EngineConfig. One machine can so run the paths of a smaller
CPU: CI runs the AVX2 paths on AVX-512 machines this way.

This module is also the one map from an ISA level to the builds of the C++ extensions (`kernel_build`,
`quant_build`) and the one AMX decision (`amx`).
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

ENV = "PEREGRINE_CPU_ISA"  # config reads it into Settings.cpu_isa; named here for messages
LEVELS = ("none", "avx2", "avx512", "amx")  # ascending: each level needs every flag of the ones before
CHOICES = ("auto", *LEVELS)
_NEEDS = {  # Linux's /proc/cpuinfo flag names
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16"),
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


def detected_level(flags: frozenset[str] | None = None) -> str:
    """The highest level whose flags this CPU has (every lower level's flags included)."""
    flags = cpu_flags() if flags is None else flags
    level = "none"
    for name in LEVELS[1:]:
        if not all(flag in flags for flag in _NEEDS[name]):
            break
        level = name
    return level


def ceiling(value: str = "auto") -> str:
    """The cap `value` names (EngineConfig.cpu_isa), checked. Unknown values raise ValueError."""
    value = value.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def isa_level(flags: frozenset[str] | None = None, cap: str = "auto") -> str:
    """The level the kernels use: what the CPU has, capped by the ceiling."""
    level, limit = detected_level(flags), ceiling(cap)
    if limit == "auto":
        return level
    return LEVELS[min(LEVELS.index(level), LEVELS.index(limit))]


def has(level: str, flags: frozenset[str] | None = None, cap: str = "auto") -> bool:
    """Whether the kernels may use `level` (one of LEVELS) here."""
    return LEVELS.index(isa_level(flags, cap)) >= LEVELS.index(level)


# The one map from an ISA level to a build of Peregrine's C++ extensions (engine.backends.build.LEVEL_FLAGS).
# AMX is picked at run time inside the avx512 build, so it needs no build of its own.
BUILDS: dict[str, str | None] = {"none": None, "avx2": "avx2", "avx512": "avx512", "amx": "avx512"}


def kernel_build(cap: str = "auto", flags: frozenset[str] | None = None) -> str | None:
    """The build of the CPU kernels (engine.backends.cpu_kernels) for this CPU under `cap`: "avx512", "avx2" or
    "neon" (every aarch64 CPU has it); None where there is none."""
    build = BUILDS[isa_level(flags, cap)]
    if build is None and platform.machine() in ("aarch64", "arm64") and ceiling(cap) != "none":
        return "neon"
    return build


def quant_build(level: str) -> str:
    """The build of the quantized-weight kernels (engine.backends.quant_kernels) for an ISA level: the kernel
    build where it is an x86 one, else "none" (the compiler's baseline: that module has a portable path)."""
    return BUILDS[level] or "none"


def amx(cap: str = "auto", flags: frozenset[str] | None = None) -> bool:
    """The one AMX decision: whether bf16 matmuls may run on AMX tiles here (the CPU has AMX-BF16 and the cap
    allows it). The decoder keeps a packed copy of the weights for them, which the preflight counts."""
    return has("amx", flags, cap)
