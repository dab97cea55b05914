"""Decode attention's own speed: one query token against a paged KV cache that comes from memory, as in a decode step
(the step's weight stream has evicted the cache from every cache level by the time a layer attends).

It builds one K and one V cache per layer (`--layers`, 28 by default: Qwen3-0.6B's, whose float16 cache at 1,024
positions is 117 MB, past any L3), in blocks of 16 slots handed out in a random order as a long-running server's
are, and times `paged_decode_attention` (engine/backends/csrc/attention.cpp, the code the one-call decoder's
attention runs) over every layer for each context length (`--ctx`), the median of `--repeats`. It prints ms a step
(all layers) and the GB/s of K and V that pace is: compare it with scripts/bandwidth.py's read figure, the pace the
cache could be read at. Prints a table, then one JSON object. Not a test.

    python scripts/bench_attention.py                            # Qwen3-0.6B's heads, float16 cache
    python scripts/bench_attention.py --heads 32 --kv-heads 8 --head-dim 64 --layers 16   # Llama-3.2-1B's
    python scripts/bench_attention.py --layers 1                 # one layer: the cache stays in L2 / L3

For a kernel change, run this script from both checkouts in turns (A B A B ...): a shared host's pace moves 20-30%
minute to minute, and a 1.2x change needs rounds to stand out of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import tool_cache_dir  # noqa: E402
from engine.backends import cpu_features, cpu_kernels  # noqa: E402

BLOCK = 16
DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def time_step(module, layers: int, heads: int, kv_heads: int, dim: int, ctx: int, dtype: torch.dtype,
              repeats: int) -> float:
    """Median seconds of one decode step's attention over `layers` caches of `ctx` positions."""
    blocks = -(-ctx // BLOCK)
    gen = torch.Generator().manual_seed(ctx)
    caches = [(torch.randn(blocks * BLOCK, kv_heads, dim, generator=gen).to(dtype),
               torch.randn(blocks * BLOCK, kv_heads, dim, generator=gen).to(dtype)) for _ in range(layers)]
    q = torch.randn(1, heads, dim, generator=gen).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    tables = torch.randperm(blocks, generator=gen)[None, :].long()
    lengths = torch.tensor([ctx])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in caches:
            module.paged_decode_attention(q, k, v, tables, lengths, BLOCK, dim ** -0.5, 0.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="context lengths")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=16, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-dtype", choices=sorted(DTYPES), default="float16")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    module = cpu_kernels.load(tool_cache_dir())
    if module is None:
        print("the CPU kernels do not load here (see the log line above)", file=sys.stderr)
        return 1
    dtype = DTYPES[args.kv_dtype]
    rows = []
    for ctx in args.ctx:
        seconds = time_step(module, args.layers, args.heads, args.kv_heads, args.head_dim, ctx, dtype, args.repeats)
        kv_bytes = args.layers * 2 * ctx * args.kv_heads * args.head_dim * dtype.itemsize
        rows.append({"ctx": ctx, "ms": round(seconds * 1e3, 3), "kv_mb": round(kv_bytes / 1e6, 1),
                     "gb_s": round(kv_bytes / seconds / 1e9, 4)})
    print(f"CPU kernels {module.isa()} (this CPU: {cpu_features.detected_level()}), {torch.get_num_threads()} threads,"
          f" {args.layers} layers, {args.heads} / {args.kv_heads} heads of {args.head_dim}, {args.kv_dtype} cache")
    print("| context | ms a step | K and V (MB) | GB/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['ctx']} | {r['ms']:.2f} | {r['kv_mb']:.1f} | {r['gb_s']:.1f} |")
    print(json.dumps({"isa": module.isa(), "threads": torch.get_num_threads(), "layers": args.layers,
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "kv_dtype": args.kv_dtype, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
