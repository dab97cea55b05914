"""Compile-check Peregrine's CPU kernels for every x86 build (engine.backends.build.LEVEL_FLAGS), on any x86 machine.

A CPU can only run the builds of the levels it has (an AVX2-only machine runs none of avx_vnni, avx512,
avx512_bf16), but it can compile them all. The probe (seconds a build: vec.h and the int8 dot products of qdot.h,
which include no torch header beyond c10's BFloat16/Half) is compiled to assembly with each build's flags and
checked for what the build promises (the builds compile at once, one compiler each):

- vec.h picked the build's vector width, and names the build (`PEREGRINE_BUILD`, the module's `isa()`) as
  engine.backends.cpu_features does;
- the int8 dot products multiply with `vpdpbusd` in the builds with VNNI (`{vex} vpdpbusd` in avx_vnni: AVX-VNNI's
  encoding, which a CPU without AVX-512 runs) and without it in avx2; no instruction of a level a build does not
  need (no zmm register below avx512, no EVEX-only `vpdpbusd` in avx_vnni).

With `--full` every `engine/backends/csrc/*.cpp` is also compiled (to an object, not linked) with each build's
flags: the files include torch's headers, so that takes minutes a file and is left out of the suite. The test
tests/unit/test_check_x86.py runs the probe.

    python scripts/check_x86.py            # the probe, every x86 build
    python scripts/check_x86.py --full     # and every source file

Exit status 0 when everything compiles and the checks hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "engine" / "backends" / "csrc"
BUILDS = ("avx2", "avx_vnni", "avx512", "avx512_bf16")  # the x86 builds of engine.backends.build.LEVEL_FLAGS
WIDTH = {"avx2": 8, "avx_vnni": 8, "avx512": 16, "avx512_bf16": 16}  # vec.h's float32 lanes
# The int8 dot products, compiled (explicit instantiations) so that their instructions show in the assembly.
PROBE = """#include "{vec}"
#include "{qdot}"
#include <cstring>
static_assert(peregrine::Vec::W == {width}, "vec.h picked another vector backend");
constexpr bool same(const char* a, const char* b) {{ return *a == *b && (*a == 0 || same(a + 1, b + 1)); }}
static_assert(same(PEREGRINE_BUILD, "{build}"), "vec.h names another build");
namespace peregrine_quant {{
template void qlinear_rows<float>(int, const uint8_t*, int64_t, const QRows&, int64_t, const float*, float*, int64_t,
                                  int64_t, int64_t, QScratch&);
}}
"""


def compiler() -> str:
    from torch.utils.cpp_extension import get_cxx_compiler

    return get_cxx_compiler()


def includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]


def level_flags(build: str) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from engine.backends.build import level_flags as flags

    return flags(build)


def probe_failures(build: str, assembly: str) -> list[str]:
    """What the probe's assembly for `build` breaks of the build's promises (empty when nothing)."""
    vnni_vex = re.findall(r"\{vex\}\s*vpdpbusd", assembly)
    vnni = re.findall(r"\bvpdpbusd\b", assembly)
    failures = []
    if build == "avx2" and vnni:
        failures.append("avx2: vpdpbusd in a build for CPUs without VNNI")
    if build == "avx_vnni" and (not vnni_vex or len(vnni_vex) != len(vnni)):
        failures.append(f"avx_vnni: {len(vnni_vex)} AVX-VNNI ({{vex}}) vpdpbusd of {len(vnni)}, want all and > 0")
    if build in ("avx512", "avx512_bf16") and (not vnni or vnni_vex):
        failures.append(f"{build}: {len(vnni)} vpdpbusd ({len(vnni_vex)} VEX), want AVX-512 VNNI's")
    if build in ("avx2", "avx_vnni") and "%zmm" in assembly:
        failures.append(f"{build}: 512-bit registers in a 256-bit build")
    if build in ("avx512", "avx512_bf16") and "%zmm" not in assembly:
        failures.append(f"{build}: no 512-bit register (the packed loop's vpdpbusd is 512 bits)")
    if "vdpbf16ps" in assembly or "tdpbf16ps" in assembly:
        failures.append(f"{build}: bf16 dot products in the int8 kernels")
    return failures


def check_probe(builds: tuple[str, ...] = BUILDS) -> list[tuple[str, str]]:
    """(build, why) for each x86 build whose probe does not compile or breaks its promises. The builds compile at
    the same time, one compiler each."""
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        running = {}
        for build in builds:
            source = Path(tmp) / f"probe_{build}.cpp"
            source.write_text(PROBE.format(vec=CSRC / "vec.h", qdot=CSRC / "qdot.h", width=WIDTH[build], build=build))
            out = Path(tmp) / f"probe_{build}.s"
            running[build] = (out, subprocess.Popen(
                [compiler(), "-std=c++17", "-S", "-O2", *level_flags(build), *includes(), "-o", str(out), str(source)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))  # fmt: skip
        for build, (out, process) in running.items():
            _, errors = process.communicate()
            if process.returncode != 0:
                failures.append((build, errors[-4000:]))
                continue
            failures += [(build, why) for why in probe_failures(build, out.read_text())]
    return failures


def check_sources(sources: list[Path], builds: tuple[str, ...] = BUILDS) -> list[tuple[str, str]]:
    """(build + file, compiler's errors) for each source that does not compile with a build's flags."""
    failures = []
    for build in builds:
        for source in sources:
            done = subprocess.run([compiler(), "-std=c++17", "-c", "-O1", *level_flags(build), *includes(),
                                   "-DTORCH_EXTENSION_NAME=check", "-o", "/dev/null", str(source)],
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:
                failures.append((f"{build} {source.name}", done.stderr[-4000:]))
            print(f"{build} {source.name}: {'ok' if done.returncode == 0 else 'FAILED'}", flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also compile every csrc/*.cpp (minutes a file)")
    parser.add_argument("--builds", default=",".join(BUILDS), help="comma-separated, default: every x86 build")
    parser.add_argument("sources", nargs="*", type=Path, help="with --full, default: every csrc/*.cpp")
    args = parser.parse_args()
    builds = tuple(b for b in args.builds.split(",") if b)
    failures = check_probe(builds)
    if args.full:
        failures += check_sources(args.sources or sorted(CSRC.glob("*.cpp")), builds)
    for what, why in failures:
        print(f"--- {what}\n{why}")
    print(f"x86 builds {', '.join(builds)}: {'every check holds' if not failures else f'{len(failures)} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
