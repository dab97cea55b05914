"""The weights a decode step streams, moved into one buffer on transparent huge pages, in the order it reads them.

At one row a decode step reads every weight once, so its speed is the memory read bandwidth. Read through 4 KiB
pages, the weights cost a TLB miss every 4 KiB and the hardware prefetchers stop at each page boundary; on 2 MiB
pages they do not (`scripts/bandwidth.py`: `read` against `read_thp`, e.g. 41 against 48.6 GB/s on an AMD EPYC
Zen 5). Linux gives huge pages to memory marked MADV_HUGEPAGE (the default `madvise` mode of
/sys/kernel/mm/transparent_hugepage/enabled), which torch's allocator does not do.

`gather(tensors, views)` copies what `tensors` read of their storages, in that order, into one such buffer and
re-points every tensor object on those storages (`tensors` and `views`: the model's parameters and buffers, the
fused weights) storage by storage, so the old copy is freed as it goes, and handed back to the OS every 64 MiB moved
(glibc keeps freed heap blocks, so without that the peak held the weights twice). Bytes no tensor reads are left
behind, so a storage that only partly holds weights (tensors viewing slices of a larger buffer) does not bring its
unread rest along.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
from collections.abc import Iterable, Sequence

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line
TRIM_EVERY = 64 << 20  # bytes moved between two hand-backs of the freed old copies
PIECE = 16 << 20  # a storage is copied in pieces of this many bytes, each given back once copied (`_move`)


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """uint8 [nbytes] on memory marked for transparent huge pages, 2 MiB aligned; None where the OS has no such
    advice (not Linux). The mapping lives as long as a tensor views it."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes <= 0:
        return None
    # private and anonymous (a shared one would be shmem, which takes huge pages only where shmem_enabled says so)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first write, so the faults take huge pages
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) of its storage that `t` reads."""
    size = t.element_size()
    last = t.storage_offset() + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() * size, (last + 1) * size if t.numel() else t.storage_offset() * size


def _holding(spans: list[list[int]], t: torch.Tensor) -> list[int]:
    """The merged span [start, end, slot] of its storage that holds `t`'s first byte."""
    first = _span(t)[0]
    return next(s for s in spans if s[0] <= first < max(s[1], s[0] + 1))


def gather(tensors: Sequence[torch.Tensor], views: Iterable[torch.Tensor]) -> int:
    """Move what `tensors` read of their CPU storages into one huge-page buffer, in their order, and re-point each
    tensor of `tensors` and `views` on those storages. Only the spans some tensor reads are kept: bytes no tensor
    reads are left behind and freed. Returns the bytes moved (0: nothing moved, the tensors are as they were)."""
    users: dict[int, dict[int, torch.Tensor]] = {}  # storage address -> the tensor objects on it
    for t in tensors:
        if t.device.type == "cpu":
            users.setdefault(t.untyped_storage().data_ptr(), {})
    for t in (*tensors, *views):
        while t is not None:  # a view's base (held where the garbage collector does not see it) moves too
            key = t.untyped_storage().data_ptr()
            if key in users:
                users[key][id(t)] = t
            t = t._base
    spans: dict[int, list[list[int]]] = {}  # storage -> its read spans merged, [start, end, slot]
    for key, found in users.items():
        merged: list[list[int]] = []
        for start, end in sorted(_span(t) for t in found.values()):
            start -= start % ALIGN  # a span keeps its cache-line offset, so every element stays aligned
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end, -1])
        spans[key] = merged
    total = 0
    for t in (*tensors, *(t for found in users.values() for t in found.values())):  # step order, then the rest
        if t.device.type != "cpu" or (key := t.untyped_storage().data_ptr()) not in spans:
            continue
        span = _holding(spans[key], t)
        if span[2] < 0:
            span[2], total = total, total + -(-(span[1] - span[0]) // ALIGN) * ALIGN
    buffer = huge_page_buffer(total) if users else None
    if buffer is None:
        return 0
    untrimmed = 0
    with torch.no_grad():
        for key in list(users):
            _move(users.pop(key), spans[key], buffer)  # (the old storage goes once its last tensor is re-pointed)
            untrimmed += sum(end - start for start, end, _ in spans[key])
            if untrimmed >= TRIM_EVERY:  # the old copies are mostly heap blocks glibc would keep: hand them back as
                release_freed_memory()  # they go, so the peak is the buffer plus what is not moved yet, not twice
                untrimmed = 0
    release_freed_memory()
    log.info("decode-step weights on transparent huge pages: %.1f MiB in one buffer", total / 2**20)
    return total


def _move(found: dict[int, torch.Tensor], spans: list[list[int]], buffer: torch.Tensor) -> None:
    """Copy one storage's read spans to their slots in `buffer` and re-point its tensors (`found`: every tensor object
    on it). Where those are all the storage's users (its use count says so: nothing else can read it), each piece
    copied is given back to the OS at once, so the storage being moved is not resident twice (the embedding of a
    large vocabulary is a few hundred MB)."""
    storage = next(iter(found.values())).untyped_storage()
    old = torch.empty(0, dtype=torch.uint8).set_(storage)
    sole = torch._C._storage_Use_Count(storage._cdata) == len(found) + 2  # found's, old's and `storage` itself
    for start, end, slot in spans:
        for lo in range(start, end, PIECE):
            hi = min(end, lo + PIECE)
            buffer[slot + lo - start : slot + hi - start].copy_(old[lo:hi])
            if sole:
                give_back(old.data_ptr() + lo, hi - lo)
    del old, storage
    target, base = buffer.untyped_storage(), buffer.storage_offset()
    for t in found.values():
        start, _, slot = _holding(spans, t)
        t.set_(target, (base + slot + _span(t)[0] - start) // t.element_size(), t.size(), t.stride())


def give_back(address: int, nbytes: int) -> None:
    """madvise(MADV_DONTNEED) the whole pages inside [address, address + nbytes) of private anonymous memory that
    nothing reads again (it reads as zero after; the allocator may still free and reuse it)."""
    lo, hi = whole_pages(address, address + nbytes)
    if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc: the copy is simply freed at the end
            _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def whole_pages(start: int, end: int) -> tuple[int, int]:
    """[lo, hi): the whole pages inside the byte range [start, end) (hi <= lo where it holds none)."""
    page = mmap.PAGESIZE
    return -(-start // page) * page, end // page * page


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc keeps them otherwise, and RSS stays at its peak)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        _libc().malloc_trim(0)
