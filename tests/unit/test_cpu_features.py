"""The CPU feature probe, the ISA cap the kernel pickers obey (EngineConfig.cpu_isa), the one ISA map."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.backends import cpu_features

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
AMX = AVX512 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize(("flags", "level"), [
    (frozenset(), "none"), (frozenset({"avx", "avx2"}), "none"), (AVX2, "avx2"),
    (AVX2 | {"avx512f", "avx512bw", "avx512vl"}, "avx2"),  # AVX-512 without BF16: the kernels' AVX2 level
    (AVX512, "avx512"), (AMX, "amx"), (AVX2 | {"amx_tile", "amx_bf16"}, "avx2"),
])  # fmt: skip
def test_detected_level_needs_every_lower_level(flags: frozenset[str], level: str) -> None:
    assert cpu_features.detected_level(flags) == level


@pytest.mark.parametrize(("cap", "level"), [("auto", "amx"), ("amx", "amx"), ("avx512", "avx512"),
                                            ("avx2", "avx2"), ("none", "none")])  # fmt: skip
def test_ceiling_caps_the_level(cap: str, level: str) -> None:
    assert cpu_features.isa_level(AMX, cap) == level
    assert cpu_features.has("avx2", AMX, cap) == (level != "none")
    assert cpu_features.has("amx", AMX, cap) == (level == "amx") == cpu_features.amx(cap, AMX)


def test_ceiling_never_raises_the_level() -> None:
    assert cpu_features.isa_level(AVX2, "amx") == "avx2"
    assert not cpu_features.has("avx512", AVX2, "amx")


def test_unknown_ceiling_is_refused() -> None:
    with pytest.raises(ValueError, match="PEREGRINE_CPU_ISA='sse9'"):
        cpu_features.isa_level(AMX, "sse9")


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_features.cpu_flags.__wrapped__(info) == frozenset({"fpu", "avx", "avx2", "fma", "f16c"})
    assert cpu_features.cpu_flags.__wrapped__(tmp_path / "missing") == frozenset()


def test_kernels_follow_a_lowered_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every level hidden (`none`), the kernel pickers hand out torch's ops even after the kernels loaded once;
    with AVX-512 hidden they pick the AVX2 build."""
    import torch

    from config import tool_cache_dir
    from engine.backends import cpu_kernels
    from engine.backends.kernels import KernelOptions, linear_torch

    assert cpu_kernels.build_level("avx2") == ("avx2" if cpu_features.detected_level() != "none" else None)
    off = KernelOptions(True, tool_cache_dir(), "none")
    assert cpu_kernels.build_level("none") is None
    assert cpu_kernels.load(tool_cache_dir(), cap="none") is None
    assert cpu_kernels.linear_for(torch.bfloat16, off) is linear_torch
    assert cpu_kernels.llama_decoder_for(torch.bfloat16, off) is None
    assert cpu_kernels.argmax_for(off) is cpu_kernels.argmax_torch


def test_cpu_vendor_reads_the_vendor_id(tmp_path: Path) -> None:
    """The vendor as /proc/cpuinfo names it (x86), "" where it names none (aarch64) or there is no such file."""
    amd = tmp_path / "amd"
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nflags\t\t: fpu avx2\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n")
    assert cpu_features.cpu_vendor(amd) == "AuthenticAMD"
    assert cpu_features.cpu_vendor(arm) == ""
    assert cpu_features.cpu_vendor(tmp_path / "missing") == ""
