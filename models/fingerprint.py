"""A GGUF file's identity for the caches derived from it (dense conversions, packed quantized copies)."""

from __future__ import annotations

import hashlib
from pathlib import Path

_HASH_CHUNK = 4 * 1024 * 1024


def gguf_fingerprint(path: Path) -> str:
    """A short content hash: size + first and last 4 MiB (the header and tensor data both change)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_HASH_CHUNK))
        f.seek(max(0, size - _HASH_CHUNK))
        digest.update(f.read(_HASH_CHUNK))
    return digest.hexdigest()[:16]
