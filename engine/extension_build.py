"""One guard around every build of Peregrine's C++ extensions (torch's `cpp_extension.load`).

torch's builder serialises builds of one folder with a `lock` file it creates and deletes; a builder killed
mid-build (a server stopped while it compiled, a test timed out) leaves that file behind, and every later start
then waits on it forever. Builds here take an `flock` first, which the kernel drops when its holder dies, so
while it is held no other builder can be running in that folder and a `lock` file found there is stale.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

TORCH_LOCK = "lock"  # torch.utils.file_baton's file in the build directory


@contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's flock for the block, after clearing a stale torch lock left by a dead builder."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".peregrine-build.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits while another live process builds here
        try:
            stale = build_dir / TORCH_LOCK
            if stale.exists():
                log.warning("removing %s, left by a build that was stopped midway", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
