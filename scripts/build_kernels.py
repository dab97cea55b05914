"""Build the CPU kernels (engine/backends/cpu_kernels.py) and the quantized-weight kernels (quant_kernels.py) of the
ISA levels given, all at once, into the cache a server reads them from (PEREGRINE_CACHE_DIR, else
~/.cache/peregrine): a server's first start then skips the compile (minutes on two cores). For a container image, or
a machine that will run several levels (scripts/bench_isa.py, the suite on an AVX-512 machine). Only levels this CPU
runs: each module is imported once built.

    python scripts/build_kernels.py                      # this CPU's level
    MAX_JOBS=16 python scripts/build_kernels.py avx2,avx512,avx512_bf16

Prints one line per module built (or why it failed) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import tool_cache_dir  # noqa: E402
from engine.backends import cpu_features, cpu_kernels, quant_kernels  # noqa: E402
from engine.backends.build import build_extension  # noqa: E402


def modules(levels: list[str]) -> dict[tuple[str, str], list[Path]]:
    """(module name, build) -> its sources, for every level: the CPU kernels' build and the quantized variant."""
    cpu_sources = cpu_kernels.sources()
    quant_sources = [quant_kernels.CSRC / s for s in quant_kernels.SOURCES]
    found: dict[tuple[str, str], list[Path]] = {}
    for level in levels:
        build = cpu_kernels.build_level(level)
        if build is not None:
            found[(cpu_kernels.NAME, build)] = cpu_sources
        found[(quant_kernels.NAME, quant_kernels.variant(level))] = quant_sources
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("levels", nargs="?", help=f"comma-separated, of {', '.join(cpu_features.LEVELS)} "
                   "(default: this CPU's)")
    args = p.parse_args(argv)
    levels = args.levels.split(",") if args.levels else [cpu_features.detected_level()]
    unknown = [level for level in levels if level not in cpu_features.available_levels()]
    if unknown:  # a build is imported once built (torch's builder does both), and this CPU cannot import those
        p.error(f"this CPU cannot run {', '.join(unknown)} (it runs {', '.join(cpu_features.available_levels())})")
    failed: list[str] = []

    def build(name: str, level: str, sources: list[Path]) -> None:
        started = time.perf_counter()
        try:
            build_extension(name, sources, level, tool_cache_dir())
            print(f"built {name} {level} in {time.perf_counter() - started:.0f} s", flush=True)
        except Exception as exc:  # report it and go on: the other builds still count
            failed.append(f"{name} {level}")
            print(f"FAILED {name} {level}: {str(exc).strip().splitlines()[-1:]}", flush=True)

    threads = [threading.Thread(target=build, args=(name, level, sources))
               for (name, level), sources in modules(levels).items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
