"""The memory's read bandwidth, measured now: the bound `--weight-format auto` puts on dense copies and the figure
scripts/bandwidth.py prints (its other reads and copies time themselves with `best_seconds` too)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call (page faults and lazy allocation stay
    out of the timing)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s this machine reads now: the best of `repeats` sums over `nbytes` of float32 (scripts/bandwidth.py's
    "read", with the threads torch uses), far beyond the caches."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_seconds(x.sum, repeats)
