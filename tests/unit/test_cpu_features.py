"""The CPU feature probe, the ISA cap the kernel pickers obey (EngineConfig.cpu_isa), the one ISA map."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.backends import cpu_features

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
AMX = AVX512 | {"amx_tile", "amx_bf16"}

# The flags of real CPUs that matter here, as Linux names them (each has more, which do not change its level).
ZEN3 = AVX2 | {"sse4_2", "bmi2"}  # AMD EPYC Milan, this suite's machine
SKYLAKE_SP = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # no VNNI
CASCADE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
ICE_LAKE = CASCADE_LAKE | {"avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq"}  # no AVX-VNNI, no BF16
COOPER_LAKE = CASCADE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ICE_LAKE | {"avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}
ALDER_LAKE = AVX2 | {"avx_vnni"}  # AVX-512 fused off
ZEN4 = ICE_LAKE | {"avx512_bf16"}  # no AVX-VNNI
ZEN5 = ZEN4 | {"avx_vnni", "avx512_vp2intersect"}
CPUS = {"zen3": ZEN3, "skylake_sp": SKYLAKE_SP, "cascade_lake": CASCADE_LAKE, "ice_lake": ICE_LAKE,
        "cooper_lake": COOPER_LAKE, "sapphire_rapids": SAPPHIRE_RAPIDS, "alder_lake": ALDER_LAKE, "zen4": ZEN4,
        "zen5": ZEN5}


@pytest.mark.parametrize(("flags", "level"), [
    (frozenset(), "none"), (frozenset({"avx", "avx2"}), "none"), (AVX2, "avx2"),
    (AVX2 | {"avx512f", "avx512bw", "avx512vl"}, "avx2"),  # AVX-512 without VNNI: the kernels' AVX2 level
    (AVX512, "avx512_bf16"), (AMX, "amx"), (AVX2 | {"amx_tile", "amx_bf16"}, "avx2"),
    (frozenset({"avx_vnni", "avx512_vnni", "avx512_bf16"}), "none"),  # no AVX2: no level above none
    (AVX512 - {"avx512_vnni"}, "avx2"),  # BF16 without VNNI (no such CPU): neither 512-bit level
])  # fmt: skip
def test_detected_level_needs_every_flag_of_its_level(flags: frozenset[str], level: str) -> None:
    assert cpu_features.detected_level(flags) == level


@pytest.mark.parametrize(("cpu", "level", "available"), [
    ("zen3", "avx2", ["none", "avx2"]),
    ("skylake_sp", "avx2", ["none", "avx2"]),
    ("cascade_lake", "avx512", ["none", "avx2", "avx512"]),
    ("ice_lake", "avx512", ["none", "avx2", "avx512"]),
    ("cooper_lake", "avx512_bf16", ["none", "avx2", "avx512", "avx512_bf16"]),
    ("sapphire_rapids", "amx", ["none", "avx2", "avx_vnni", "avx512", "avx512_bf16", "amx"]),
    ("alder_lake", "avx_vnni", ["none", "avx2", "avx_vnni"]),
    ("zen4", "avx512_bf16", ["none", "avx2", "avx512", "avx512_bf16"]),
    ("zen5", "avx512_bf16", ["none", "avx2", "avx_vnni", "avx512", "avx512_bf16"]),
])  # fmt: skip
def test_levels_of_real_cpus(cpu: str, level: str, available: list[str]) -> None:
    flags = CPUS[cpu]
    assert cpu_features.detected_level(flags) == level
    assert cpu_features.available_levels(flags) == available
    for name in available:  # every level it has is its own cap's level, and needs no flag it lacks
        assert cpu_features.isa_level(flags, name) == name
        assert set(cpu_features.needs(name)) <= flags


@pytest.mark.parametrize(("cpu", "cap", "level"), [
    ("sapphire_rapids", "auto", "amx"), ("sapphire_rapids", "amx", "amx"),
    ("sapphire_rapids", "avx512_bf16", "avx512_bf16"), ("sapphire_rapids", "avx512", "avx512"),
    ("sapphire_rapids", "avx_vnni", "avx_vnni"), ("sapphire_rapids", "avx2", "avx2"),
    ("sapphire_rapids", "none", "none"),
    ("ice_lake", "avx_vnni", "avx2"),  # the cap's level is missing: the highest below it that the CPU has
    ("ice_lake", "amx", "avx512"), ("ice_lake", "avx512_bf16", "avx512"),
    ("zen4", "avx512", "avx512"), ("zen4", "avx_vnni", "avx2"),
    ("zen5", "avx_vnni", "avx_vnni"), ("zen5", "amx", "avx512_bf16"),
    ("alder_lake", "avx512", "avx_vnni"), ("alder_lake", "auto", "avx_vnni"),
    ("skylake_sp", "avx512", "avx2"), ("zen3", "amx", "avx2"), ("zen3", "avx_vnni", "avx2"),
])  # fmt: skip
def test_a_cap_picks_the_highest_level_at_or_below_it_that_the_cpu_has(cpu: str, cap: str, level: str) -> None:
    assert cpu_features.isa_level(CPUS[cpu], cap) == level


@pytest.mark.parametrize(("cap", "level"), [("auto", "amx"), ("amx", "amx"), ("avx512_bf16", "avx512_bf16"),
                                            ("avx512", "avx512"), ("avx_vnni", "avx2"), ("avx2", "avx2"),
                                            ("none", "none")])  # fmt: skip
def test_ceiling_caps_the_level(cap: str, level: str) -> None:
    assert cpu_features.isa_level(AMX, cap) == level
    assert cpu_features.has("avx2", AMX, cap) == (level != "none")
    assert cpu_features.has("amx", AMX, cap) == (level == "amx") == cpu_features.amx(cap, AMX)


def test_ceiling_never_raises_the_level() -> None:
    assert cpu_features.isa_level(AVX2, "amx") == "avx2"
    assert not cpu_features.has("avx512", AVX2, "amx")
    assert not cpu_features.amx("avx512", SAPPHIRE_RAPIDS)  # avx512: the 512-bit int8 kernels, no tiles


def test_each_level_maps_to_a_build_with_exactly_its_flags() -> None:
    """The one ISA map: every level names a build, and each x86 build's compiler flags are its level's CPU flags
    (the avx512_bf16 build adds AMX's, used only where the CPU has the tiles)."""
    from engine.backends.build import LEVEL_FLAGS

    def cpu_flag(option: str) -> str:  # -mavx512vnni -> avx512_vnni, as /proc/cpuinfo spells it
        name = option.removeprefix("-m").replace("-", "_")
        return {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avxvnni": "avx_vnni"}.get(name, name)

    assert set(cpu_features.BUILDS) == set(cpu_features.LEVELS) == set(cpu_features.QUANT_BUILDS)
    for level, build in cpu_features.BUILDS.items():
        if build is None:
            assert level == "none"
            continue
        flags = {cpu_flag(option) for option in LEVEL_FLAGS[build]}
        assert flags - {"amx_tile", "amx_bf16", "amx_int8"} == set(cpu_features.needs(build)), build
        assert set(cpu_features.needs(build)) <= set(cpu_features.needs(level)), level  # runs where the level does
        quant = cpu_features.quant_build(level)
        assert {cpu_flag(option) for option in LEVEL_FLAGS[quant]} <= set(cpu_features.needs(level)), level
    assert cpu_features.BUILDS["amx"] == "avx512_bf16"  # AMX is picked at run time inside that build


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
