"""The dense small-batch matmul's own speed: `linear_small` (engine/backends/csrc/linear.cpp, the one-call decoder's
matmul on float32 / bfloat16 weights) against torch's `F.linear` on the same weights, both on the threads torch
uses, for a few activation rows (a decode step's sequences) and weight shapes, the weights read from memory: each
call takes the next of enough copies to fill twice the last-level cache, so none is cached. Prints GMAC/s (median of
the calls) per shape and row count, then one JSON object. Not a test.

    python scripts/bench_gemv.py                                  # bfloat16, rows 1 4 8 16, Qwen3-0.6B's shapes
    python scripts/bench_gemv.py --dtype float32 --rows 8 16 --shapes 2048x2048 151936x1024
    python scripts/bench_gemv.py --cpu-isa avx2                   # the AVX2 build on an AVX-512 machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import tool_cache_dir  # noqa: E402
from engine.backends import cpu_kernels  # noqa: E402

SHAPES = ["6144x1024", "1024x3072", "2048x2048", "151936x1024"]  # N x K: gate+up, down, o, the LM head
COPIES_BYTES = 400_000_000  # weights cycled through: far more than any last-level cache here


def measure(module: object, n: int, k: int, rows: list[int], dtype: torch.dtype, calls: int) -> list[dict]:
    copies = [torch.randn(n, k).to(dtype) for _ in range(max(4, COPIES_BYTES // (n * k * dtype.itemsize)))]
    results = []
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        times: dict[str, list[float]] = {"peregrine": [], "torch": []}
        for i in range(calls):
            for j, name in enumerate(times):  # alternating, each call on weights the previous calls did not read
                w = copies[(2 * i + j) % len(copies)]
                start = time.perf_counter()
                module.linear_small(x, w, None) if name == "peregrine" else F.linear(x, w)
                times[name].append(time.perf_counter() - start)
        gmac = {name: n * k * m / statistics.median(t[2:]) / 1e9 for name, t in times.items()}
        results.append({"n": n, "k": k, "rows": m, "peregrine_gmac_s": round(gmac["peregrine"], 1),
                        "torch_gmac_s": round(gmac["torch"], 1)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16], help="activation rows")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="weights as NxK (output rows x inputs)")
    parser.add_argument("--calls", type=int, default=15, help="timed calls a cell (the first two not counted)")
    parser.add_argument("--cpu-isa", default="auto", help="the ISA cap, as the server's --cpu-isa")
    args = parser.parse_args()
    module = cpu_kernels.load(tool_cache_dir(), cap=args.cpu_isa)
    if module is None:
        sys.exit(f"the CPU kernels did not build: {cpu_kernels.unsupported_reason(args.cpu_isa)}")
    dtype = getattr(torch, args.dtype)
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        results += measure(module, n, k, args.rows, dtype, args.calls)
    print(f"linear_small against F.linear, {args.dtype}, {torch.get_num_threads()} threads, {module.isa()} build, "
          "weights from memory, GMAC/s")
    print(f"{'N x K':>14}{'rows':>6}{'peregrine':>11}{'torch':>8}")
    for r in results:
        print(f"{r['n']:>7}x{r['k']:<6}{r['rows']:>6}{r['peregrine_gmac_s']:>11}{r['torch_gmac_s']:>8}")
    print(json.dumps({"isa": module.isa(), "dtype": args.dtype, "threads": torch.get_num_threads(),
                      "results": results}))


if __name__ == "__main__":
    main()
