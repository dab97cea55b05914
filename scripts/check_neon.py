"""Compile-check Peregrine's CPU kernels for aarch64 (NEON) from an x86 machine, with zig's clang.

No aarch64 g++ is needed: the `ziglang` PyPI package carries a clang that targets aarch64-linux-gnu with its own
libc and libc++ headers. Each `engine/backends/csrc/*.cpp` is checked with `-fsyntax-only` against this torch's headers, so
vec.h's NEON backend and every kernel over it type-check for aarch64 (nothing is linked or run: torch's headers
are the host's, and zig ships no omp.h, so a two-function stub stands in for it). `-c`: zig compiles only, so it
builds none of the libraries a link would need (without it, zig's libc++, libc++abi and glibc stubs for aarch64: 100 s
on 2 cores, cached by a key that holds zig's own path, so rebuilt for every new venv: every fresh clone's suite).
The probe takes seconds; a file with torch's headers, minutes.

    python -m venv .cache/zig-venv && .cache/zig-venv/bin/pip install ziglang
    python scripts/check_neon.py --zig-python .cache/zig-venv/bin/python

Exit status 0 when every file compiles, 1 otherwise (the compiler's errors are printed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "engine" / "backends" / "csrc"
OMP_STUB = "#pragma once\nextern \"C\" {\nint omp_get_num_threads(void);\nint omp_get_thread_num(void);\n}\n"
# Compiled first: the check must see vec.h's NEON backend, not its scalar fallback. It also compiles the int8 dot
# products (qdot.h and what it includes), which need no torch header: seconds, where a file with torch's take minutes.
NEON_PROBE = (f'#include "{CSRC / "vec.h"}"\n#include "{CSRC / "qdot.h"}"\n'
              'static_assert(peregrine::Vec::W == 4, "vec.h did not pick NEON");\n')


def command(zig_python: str, source: Path, stub_dir: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    return [zig_python, "-m", "ziglang", "c++", "-target", "aarch64-linux-gnu", "-std=c++17", "-c", "-fsyntax-only",
            "-fopenmp", "-Wno-everything", f"-I{stub_dir}", *includes, "-DTORCH_EXTENSION_NAME=check",
            str(source)]


def check(zig_python: str, sources: list[Path]) -> list[tuple[Path, str]]:
    """The sources that fail to compile for aarch64, each with the compiler's output."""
    failures = []
    with tempfile.TemporaryDirectory() as stub:
        (Path(stub) / "omp.h").write_text(OMP_STUB)
        (Path(stub) / "neon_probe.cpp").write_text(NEON_PROBE)
        for source in [Path(stub) / "neon_probe.cpp", *sources]:
            done = subprocess.run(command(zig_python, source, Path(stub)), capture_output=True, text=True)
            # zig reports "failed to rename ... .o" after a clean -fsyntax-only run (it has no object to cache):
            # only the compiler's own errors count
            errors = [line for line in done.stderr.splitlines() if "error" in line and "failed to rename" not in line]
            if done.returncode != 0 and errors:
                failures.append((source, "\n".join(errors)[-4000:]))
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zig-python", default=sys.executable, help="a Python with the ziglang package")
    parser.add_argument("sources", nargs="*", type=Path, help="default: every engine/backends/csrc/*.cpp")
    args = parser.parse_args()
    sources = args.sources or sorted(CSRC.glob("*.cpp"))
    failures = check(args.zig_python, sources)
    for source, errors in failures:
        print(f"--- {source.name}: does not compile for aarch64\n{errors}")
    print(f"aarch64 (NEON): {len(sources) - len(failures)}/{len(sources)} files compile")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
