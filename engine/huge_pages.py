"""The weights a decode step streams, moved into one buffer on transparent huge pages, in the order it reads them.

At one row a decode step reads every weight once, so its speed is the memory read bandwidth. Read through 4 KiB
pages, the weights cost a TLB miss every 4 KiB and the hardware prefetchers stop at each page boundary; on 2 MiB
pages they do not (`scripts/bandwidth.py`: `read` against `read_thp`, e.g. 41 against 48.6 GB/s on an AMD EPYC
Zen 5). Linux gives huge pages to memory marked MADV_HUGEPAGE (the default `madvise` mode of
/sys/kernel/mm/transparent_hugepage/enabled), which torch's allocator does not do.

`gather(tensors, views)` copies the storages of `tensors`, in that order, into one such buffer and re-points every
tensor object that views them (`tensors` and `views`: the model's parameters and buffers, the fused weights)
storage by storage, so the old copy is freed as it goes (the peak is one storage more, not a second model).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from collections.abc import Iterable, Sequence

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line


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


def gather(tensors: Sequence[torch.Tensor], views: Iterable[torch.Tensor]) -> int:
    """Move the CPU storages of `tensors` into one huge-page buffer, in order; re-point each tensor of `tensors`
    and `views` that uses one of them. Returns the bytes moved (0: nothing moved, the tensors are as they were)."""
    slots: dict[int, tuple[torch.UntypedStorage, int]] = {}  # storage address -> (storage, offset in the buffer)
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.data_ptr() not in slots:
            slots[storage.data_ptr()] = (storage, total)
            total += -(-storage.nbytes() // ALIGN) * ALIGN
    buffer = huge_page_buffer(total) if slots else None
    if buffer is None:
        return 0
    users: dict[int, dict[int, torch.Tensor]] = {key: {} for key in slots}  # storage -> the tensor objects on it
    for t in (*tensors, *views):
        while t is not None:  # a view's base (held where the garbage collector does not see it) moves too
            key = t.untyped_storage().data_ptr()
            if key in users:
                users[key][id(t)] = t
            t = t._base
    target, base = buffer.untyped_storage(), buffer.storage_offset()
    with torch.no_grad():
        for key in list(slots):
            storage, offset = slots.pop(key)  # (the old storage goes once its last tensor is re-pointed)
            old = torch.empty(0, dtype=torch.uint8).set_(storage)
            buffer[offset : offset + storage.nbytes()].copy_(old)
            del old
            for t in users.pop(key).values():
                size = t.element_size()
                assert (base + offset) % size == 0, "storages start on cache lines"
                t.set_(target, (base + offset) // size + t.storage_offset(), t.size(), t.stride())
            del storage
    release_freed_memory()  # the old copies were small heap blocks: glibc would keep them
    log.info("decode-step weights on transparent huge pages: %.1f MiB in one buffer", total / 2**20)
    return total


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc keeps them otherwise, and RSS stays at its peak)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
