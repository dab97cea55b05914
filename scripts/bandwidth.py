"""Measure this machine's memory bandwidth, the roofline for batch-1 decoding on a CPU.

Decoding one token reads every weight once, so tokens/s at batch 1 cannot exceed
bandwidth / (bytes of weights read per token). This prints STREAM-like figures measured with torch on
buffers far larger than the caches, best of `--repeats`:

- read:  `x.sum()`                    bytes counted: |x|
- read_simd: `stream_read` (scripts/csrc/stream_read.cpp, a tiny extension this script compiles with
  -march=native on first use and caches), four vector loads per step on every thread: the weight stream of a
  decode step without its arithmetic (AVX-512 loads where the CPU has them, else AVX2; was `read_avx512`)
- read_thp, read_simd_thp: the same two reads of a buffer on transparent huge pages (MADV_HUGEPAGE), the
  memory the one-call decode step keeps its packed weights in
- copy:  `y.copy_(x)`                 bytes counted: |x| + |y|
- scale: `torch.mul(x, 3.0, out=y)`   bytes counted: |x| + |y|

    python scripts/bandwidth.py                  # 512 MiB buffers, all cores torch uses
    python scripts/bandwidth.py --threads 2 --json bench-results/bandwidth.json
    python scripts/bandwidth.py --weights-mb 269 # also the batch-1 roofline for 269 MB of weights

A few seconds of work; do not run it while other heavy jobs share the machine (it measures what is left).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # config and engine, from any working folder


def measure(size_mb: int, repeats: int, threads: int | None, simd: bool = True) -> dict[str, float]:
    """GB/s (1e9 bytes per second) for read, copy and scale over float32 buffers of `size_mb` MiB (and the
    hand-written reads unless `simd` is False: they compile a small extension on first use)."""
    import torch

    from models.autotune.bandwidth import best_seconds  # the package's timing loop (torch: imported on use)

    if threads:
        torch.set_num_threads(threads)
    n = size_mb * (1 << 20) // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    kernels: dict[str, tuple[Callable[[], object], int]] = {
        "read": (lambda: x.sum(), nbytes),
        "copy": (lambda: y.copy_(x), 2 * nbytes),
        "scale": (lambda: torch.mul(x, 3.0, out=y), 2 * nbytes),
    }
    huge = _huge_page_buffer(nbytes)  # where the one-call decode step keeps its packed weights
    huge.fill_(1.0)
    kernels["read_thp"] = (lambda: huge.sum(), nbytes)
    module = _stream_read() if simd else None
    if module is not None:
        kernels["read_simd"] = (lambda: module.stream_read(x), nbytes)
        kernels["read_simd_thp"] = (lambda: module.stream_read(huge), nbytes)
    return {name: moved / best_seconds(fn, repeats) / 1e9 for name, (fn, moved) in kernels.items()}


def _huge_page_buffer(nbytes: int) -> object:
    """A float32 tensor on anonymous memory advised onto transparent huge pages (MADV_HUGEPAGE), as the
    decoder's packed weights are; ordinary memory where the kernel offers no huge pages."""
    import mmap

    import torch

    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory gets no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.float32)


def _stream_read() -> object | None:
    """The hand-written read, compiled once into <cache dir>/kernels/ by the engine's builder (keyed by the source's
    bytes, so every checkout shares it; None, said, when it cannot be built here: the torch reads still run)."""
    from config import tool_cache_dir
    from engine.backends.build import build_extension

    source = Path(__file__).with_name("csrc") / "stream_read.cpp"
    try:
        return build_extension("peregrine_stream_read", [source], "none", tool_cache_dir(), ["-march=native"])
    except Exception as exc:  # no compiler, an odd CPU: the torch reads are still worth printing
        print(f"stream_read not built ({str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}); "
              "torch's reads only")
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=512, help="MiB per buffer (two buffers are used)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--weights-mb", type=float, default=0.0, help="print the batch-1 tok/s roofline for this")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    import torch

    gbs = measure(args.size_mb, args.repeats, args.threads or None)
    result: dict[str, object] = {"size_mb": args.size_mb, "threads": torch.get_num_threads(), "gb_per_s": gbs}
    for name, value in gbs.items():
        print(f"{name:>15}: {value:6.1f} GB/s")
    if args.weights_mb:
        read = max(v for k, v in gbs.items() if k.startswith("read"))  # the best read this machine showed
        roof = read * 1e3 / args.weights_mb
        result["roofline_tok_per_s"] = roof
        print(f"batch-1 roofline for {args.weights_mb:g} MB of weights at {read:.1f} GB/s read: {roof:.0f} tok/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
