"""Probe decisions remembered per file and machine, so `--weight-format auto` times its candidates once.

A decision is kept in `<cache>/autotune/<kind>-<key>.json` (written atomically) where the key hashes everything the
timing depended on: the model file's fingerprint, the CPU (model name, feature flags, core count), the kernels'
settings (`--cpu-kernels`, `--cpu-isa`) and the probe's inputs (the candidates, the concurrency it timed, the
dtype, the torch version). Any of them changing gives another key, so the probe runs again; delete the folder (or
pass `--weight-format quantized|dense`) to re-time by hand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.backends import cpu_features

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the meaning of a remembered decision changes


@dataclass(frozen=True, slots=True)
class Decision:
    choice: str  # the candidate's name, e.g. "quantized" or "dense bfloat16"
    reason: str  # the probe's figures and rule, as it logged them
    decided_at: str  # UTC, ISO 8601
    path: Path  # the file it is kept in


def machine() -> dict[str, Any]:
    """What a timing on this machine depends on, besides the software's own settings."""
    return {"cpu": cpu_features.cpu_model_name(), "flags": sorted(cpu_features.cpu_flags()), "cores": os.cpu_count(),
            "torch": torch.__version__}


def key(**inputs: Any) -> str:
    """A short hash of `inputs` (JSON-serialisable) and of this machine."""
    text = json.dumps({"format": FORMAT, "machine": machine(), **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def recall(cache_dir: Path, kind: str, digest: str) -> Decision | None:
    """The decision kept for `digest`, or None (none kept, or a file that cannot be read: logged, then ignored)."""
    path = Path(cache_dir).expanduser() / "autotune" / f"{kind}-{digest}.json"
    try:
        data = json.loads(path.read_text())
        return Decision(str(data["choice"]), str(data["reason"]), str(data["decided_at"]), path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: the remembered decision cannot be read (%s); timing again", path, exc)
        return None


def remember(cache_dir: Path, kind: str, digest: str, choice: str, reason: str) -> Path | None:
    """Keep a decision (atomic: a crash leaves the old file or none). A cache that cannot be written only logs."""
    folder = Path(cache_dir).expanduser() / "autotune"
    path = folder / f"{kind}-{digest}.json"
    record = {"choice": choice, "reason": reason, "decided_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
            json.dump(record, f)
        os.replace(f.name, path)
    except OSError as exc:
        log.warning("could not remember the %s decision in %s: %s", kind, folder, exc)
        return None
    return path
