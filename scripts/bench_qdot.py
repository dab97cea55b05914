"""The int8 dot-product kernel's own speed: one thread multiplying activation rows (one by default) with packed
rows (Q4_1 by default) that stay in the L2 cache, so memory does not bound it (what a decode step's matmuls could do
if the weights came for free).

For each K (the row length) it times `qlinear` (engine/backends/csrc/qdot.h, the one-call decoder's matmul, on rows packed as
the loader keeps them) over about 550 KB of rows, and prints ns a row and the bytes a second a row stream would
need at that pace. Compare it with scripts/bandwidth.py's figure per core: where the kernel is slower, a decode step
is bound by compute, not by memory. Prints a table, then one JSON object. Not a test.

    python scripts/bench_qdot.py                 # the build for this CPU
    python scripts/bench_qdot.py --format Q8_0 --rows 16   # packed Q8_0 rows, 16 activation rows
    python scripts/bench_qdot.py --cpu-isa avx2  # the AVX2 build on an AVX-512 machine
    python scripts/bench_qdot.py --format Q4_K --against ../other-checkout   # a kernel change, A/B in turns

`--against CHECKOUT` runs that checkout's kernels (its engine/backends/csrc, same level, built once into the same
cache) and this one's in two processes on the same rows, timed in turns, 40 batches each, the order flipped every
batch, and prints the median of the batch-by-batch speed ratios with its quartiles (this one's speed over the
other's): a shared host's slow spells fall on both alike, where separate runs minutes apart differ by 20-30%. Their
outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf_random  # noqa: E402  (scripts/, beside this file)

from config import tool_cache_dir  # noqa: E402
from engine.backends import cpu_kernels  # noqa: E402
from engine.model.quant import FORMATS, PACKS, TILES, QuantWeight  # noqa: E402

TYPES = {name: t for t, (name, _, _) in FORMATS.items()
         if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")}
# (Q4_0 / Q4_1 / Q8_0 are packed at load, QuantWeight.repack; the K-quants are served as the file stores them; packed
# rows, Q5_0, Q4_K, Q5_K and Q6_K are tiled where the build multiplies tiles, QuantWeight.tile_)
ROWS_BYTES = 550_000  # about half of a 1 MiB L2


def random_blocks(fmt: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, bytes a row] of `fmt` (the values do not change the speed): real blocks of normal values where the
    gguf package quantizes to the format, else random bytes with small scale fields (scripts/gguf_random.py)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    qtype = getattr(GGMLQuantizationType, fmt)
    try:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype).view(np.uint8).reshape(n, -1)
    except NotImplementedError:  # the K-quants and IQ4
        return np.frombuffer(gguf_random.tensor_values(fmt, (k, n), rng), np.uint8).reshape(n, -1)


def time_rows(module: object, fmt: str, k: int, rows: int, repeats: int, tiled: bool = False,
              amx: bool = False) -> dict[str, float]:

    _, per_block, block_bytes = FORMATS[TYPES[fmt]]
    n = max(16, ROWS_BYTES // (k // per_block * block_bytes) // 16 * 16)
    blocks = torch.from_numpy(random_blocks(fmt, n, k))
    packed = QuantWeight(blocks, TYPES[fmt], (n, k)).repack()
    if tiled and packed.qtype in TILES:
        packed.tile_()  # as the engine's decoder holds them where the build multiplies tiles
    x = torch.randn(rows, k)
    qlinear = module.qlinear_amx if amx else module.qlinear
    for _ in range(200):  # warm: rows into L2, the thread pool up
        qlinear(x, packed.blocks, packed.qtype, None)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(500):
            qlinear(x, packed.blocks, packed.qtype, None)
        best = min(best, (time.perf_counter() - start) / 500)
    return {"k": k, "rows": n, "ns_per_row": round(best / n * 1e9, 2),
            "gb_s": round(packed.blocks.numel() / best / 1e9, 1)}


# One side of --against: a process on one checkout's kernels, the same rows (the same seed) as the other side, that
# times `calls` qlinear calls each time it reads a line. Two processes, because a second build of the same extension
# module cannot be imported beside the first (Python hands back the first).
_SIDE = """
import hashlib, sys, time
checkout, fmt, k, rows, tiled, cap = sys.argv[1:7]
sys.path[:0] = [checkout + "/scripts", checkout]
import torch
import bench_qdot as bq
from config import tool_cache_dir
from engine.backends import cpu_kernels
from engine.model.quant import FORMATS, TILES, QuantWeight
module = cpu_kernels.load(tool_cache_dir(), cap=cap)
torch.set_num_threads(1)
k, rows = int(k), int(rows)
_, per_block, block_bytes = FORMATS[bq.TYPES[fmt]]
n = max(16, bq.ROWS_BYTES // (k // per_block * block_bytes) // 16 * 16)
packed = QuantWeight(torch.from_numpy(bq.random_blocks(fmt, n, k).copy()), bq.TYPES[fmt], (n, k)).repack()
if tiled == "1" and packed.qtype in TILES:
    packed.tile_()
x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
call = lambda: module.qlinear(x, packed.blocks, packed.qtype, None)
for _ in range(200):
    call()
print(n, packed.blocks.numel(), hashlib.sha1(call().numpy().tobytes()).hexdigest(), flush=True)
for line in sys.stdin:
    calls = int(line)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    print((time.perf_counter() - start) / calls, flush=True)
"""


def time_against(checkouts: tuple[Path, Path], fmt: str, k: int, rows: int, tiled: bool, cap: str) -> dict:
    """This checkout's kernels (checkouts[0]) against another's, each in its own process on the same rows, timed
    in turns: 40 batches of 300 calls each, the order flipped every batch, so only one runs at a time."""
    import statistics
    import subprocess

    sides = [subprocess.Popen([sys.executable, "-c", _SIDE, str(c), fmt, str(k), str(rows), "1" if tiled else "0", cap],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=c) for c in checkouts]
    try:
        heads = [side.stdout.readline().split() for side in sides]  # one at a time would be fairer; both idle after
        if any(len(h) != 3 for h in heads):
            sys.exit(f"--against: a side did not start (its first line: {heads})")
        seconds: list[list[float]] = [[], []]
        for batch in range(40):
            for i in (0, 1) if batch % 2 else (1, 0):
                sides[i].stdin.write("300\n")
                sides[i].stdin.flush()
                seconds[i].append(float(sides[i].stdout.readline()))
    finally:
        for side in sides:
            side.stdin.close()
            side.wait(timeout=60)
    (n, nbytes, ours_bits), (_, _, their_bits) = heads
    ratios = [t / o for o, t in zip(*seconds, strict=True)]  # our speed over theirs, batch by batch
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    gb_s = [round(int(nbytes) / statistics.median(s) / 1e9, 1) for s in seconds]
    return {"k": k, "rows": int(n), "gb_s": gb_s[0], "gb_s_against": gb_s[1], "ratio": round(median, 3),
            "ratio_q1": round(q1, 3), "ratio_q3": round(q3, 3), "same_bits": ours_bits == their_bits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[576, 1536, 4608, 9216])
    parser.add_argument("--format", choices=sorted(TYPES), default="Q4_1", help="the GGUF format (as the loader keeps it)")
    parser.add_argument("--rows", type=int, default=1, help="activation rows (a decode step's sequences)")
    parser.add_argument("--repeats", type=int, default=7, help="timed batches of 500 calls; the best is reported")
    parser.add_argument("--cpu-isa", default="auto", help="the ISA cap, as the server's --cpu-isa")
    parser.add_argument("--untiled", action="store_true",
                        help="packed Q4_0 / Q4_1 / Q8_0, Q5_0, Q4_K, Q5_K and Q6_K as rows, not in the tiles the "
                             "engine gives them where the build multiplies tiles (the AVX-512 VNNI builds)")
    parser.add_argument("--amx", action="store_true",
                        help="the tiled Q4_0 / Q4_1 / Q8_0 forms on AMX int8 tiles from 9 rows (qlinear_amx: the "
                             "avx512_bf16 build on a CPU with AMX-INT8), as the decoder runs them at the amx level")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="another checkout's kernels, timed in turns with this one's (two processes, same rows)")
    args = parser.parse_args()
    module = cpu_kernels.load(tool_cache_dir(), cap=args.cpu_isa)
    if module is None:
        sys.exit(f"the CPU kernels did not build: {cpu_kernels.unsupported_reason(args.cpu_isa)}")
    torch.set_num_threads(1)
    tiled = bool(module.tile_rows()) and not args.untiled
    per_block = FORMATS[TYPES[args.format]][1]
    if skipped := [k for k in args.k if k % per_block]:
        print(f"K {', '.join(map(str, skipped))} skipped: {args.format} rows hold whole blocks of {per_block}")
    ks = [k for k in args.k if not k % per_block]
    if args.against:
        repo = Path(__file__).resolve().parents[1]
        results = [time_against((repo, args.against.resolve()), args.format, k, args.rows, tiled, args.cpu_isa)
                   for k in ks]
        print(f"qlinear, {args.format}, {args.rows} activation row(s), one thread, {module.isa()} build: this "
              f"checkout against {args.against} (speed ratio: median of 40 alternating batches, quartiles)")
        print(f"{'K':>6}{'rows':>7}{'GB/s':>8}{'against':>9}{'ratio':>8}{'q1-q3':>13}  bits")
        for r in results:
            print(f"{r['k']:>6}{r['rows']:>7}{r['gb_s']:>8}{r['gb_s_against']:>9}{r['ratio']:>8}"
                  f"{r['ratio_q1']:>7}-{r['ratio_q3']:<5}  {'same' if r['same_bits'] else 'DIFFER'}")
        print(json.dumps({"isa": module.isa(), "format": args.format, "rows": args.rows, "against": str(args.against),
                          "results": results}))
        return
    if args.amx and not module.amx_int8_available():
        sys.exit(f"--amx: the {module.isa()} build or this CPU has no AMX int8 tiles")
    results = [time_rows(module, args.format, k, args.rows, args.repeats, tiled, args.amx) for k in ks]
    layout = "tiled" if tiled and PACKS.get(TYPES[args.format], TYPES[args.format]) in TILES else "rows"
    print(f"qlinear{'_amx' if args.amx else ''}, {args.format} ({layout}), {args.rows} activation row(s), one thread, "
          f"{module.isa()} build")
    print(f"{'K':>6}{'rows':>7}{'ns a row':>10}{'GB/s':>8}")
    for r in results:
        print(f"{r['k']:>6}{r['rows']:>7}{r['ns_per_row']:>10}{r['gb_s']:>8}")
    print(json.dumps({"isa": module.isa(), "format": args.format, "layout": layout, "rows": args.rows, "threads": 1,
                      "amx": args.amx, "results": results}))


if __name__ == "__main__":
    main()
