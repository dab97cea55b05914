"""Which device and dtype the model runs on: `--device` and `--dtype` resolved through the one registry of device
kinds (`engine.backends.BACKENDS`: cpu, cuda, tt; each kind's probe and backend live in cpu.py, cuda.py, tt.py).

The device and dtype are resolved once (`resolve`, called by main.py, or on a Ray replica by the loader
when its config still says "auto"); `EngineConfig` carries the result and the rest only translates it
(`placement`, `backend_for`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.backends import BACKENDS, Backend, DeviceProbe
from engine.backends.errors import DeviceError
from engine.backends.kernels import KernelOptions
from engine.types import DTYPE_BYTES, EngineConfig

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}  # engine.types' table


PROBES: dict[str, DeviceProbe] = {kind: entry.probe for kind, entry in BACKENDS.items()}


@dataclass(frozen=True, slots=True)
class Resolved:
    """The device and dtype `EngineConfig` carries: resolved once, translated (never re-resolved) after."""

    device: str  # "cpu", "cuda:0", "tt"
    dtype: str  # "float32", "bfloat16", "float16"; "auto" on the CPU, chosen by the loader (models/autotune/dtype.py)


def resolve(device: str, dtype: str) -> Resolved:
    """--device and --dtype -> the names the engine is configured with. Raises DeviceError."""
    probe, torch_dev = resolve_probe(device)
    return Resolved(probe.device_name(torch_dev), dtype_name(resolve_dtype(dtype, torch_dev, probe)))


def placement(device: str, dtype: str) -> tuple[torch.device, torch.dtype | None]:
    """The torch device and dtype for an `EngineConfig`'s names. Resolved names are only translated; "auto"
    (a config built without main.py: tests, a Ray replica on its own node) is resolved here, once."""
    kind, index = parse_device(device)
    probe, torch_dev = resolve_probe(device) if kind == "auto" else (PROBES[kind], PROBES[kind].torch_device(index))
    return torch_dev, resolve_dtype(dtype, torch_dev, probe)


def backend_for(cfg: EngineConfig, torch_dev: torch.device) -> Backend:
    """The backend for an engine on `torch_dev`: by the configured kind ("tt" runs from host tensors), or by
    the torch device's type when the config says "auto"; with the config's kernel options."""
    kind = parse_device(cfg.device)[0]
    return BACKENDS[torch_dev.type if kind == "auto" else kind].backend(torch_dev, kernel_options(cfg))


def kernel_options(cfg: EngineConfig) -> KernelOptions:
    """What the config says about kernels: on or off, where they build, the ISA cap."""
    return KernelOptions(cfg.cpu_kernels, Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None, cfg.cpu_isa)


def aux_device(device: str) -> torch.device:
    """Where a helper torch model (the embedder) runs for an engine on `device`: a CUDA device's own, else the
    host (tt, auto: the embedder is small and not compiled for the card)."""
    kind, index = parse_device(device)
    return torch.device(device.strip().lower()) if kind == "cuda" else torch.device("cpu")


def kind_of(device: str) -> str:
    """'cuda:1' -> 'cuda', 'tt' -> 'tt', 'auto' -> 'auto'."""
    return parse_device(device)[0]


def cuda_index(device: str) -> int | None:
    """The CUDA device index of a resolved name ('cuda' is 0), None for any other kind."""
    kind, index = parse_device(device)
    return (index or 0) if kind == "cuda" else None


def parse_device(name: str) -> tuple[str, int | None]:
    """'cuda:1' -> ('cuda', 1); 'cpu' -> ('cpu', None). Raises DeviceError for unknown names."""
    kind, _, index = name.strip().lower().partition(":")
    known = kind == "auto" or kind in PROBES
    bad_index = bool(index) and (kind != "cuda" or not index.isdigit())
    if not known or bad_index:
        raise DeviceError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or tt")
    return kind, int(index) if index else None


def resolve_probe(name: str) -> tuple[DeviceProbe, torch.device]:
    """The probe and torch device for --device. auto: cuda if usable, else tt if usable, else cpu."""
    kind, index = parse_device(name)
    if kind == "auto":
        kind = next(k for k in ("cuda", "tt", "cpu") if _usable(PROBES[k]))
        log.info("device auto: picked %s", kind)
    probe = PROBES[kind]
    reason = probe.missing()
    if reason is not None:
        raise DeviceError(f"device {name!r} cannot be used: {reason}")
    return probe, probe.torch_device(index)


def resolve_device(name: str) -> torch.device:
    """--device -> torch.device, or DeviceError naming what is missing."""
    return resolve_probe(name)[1]


def resolve_dtype(name: str, device: torch.device, probe: DeviceProbe | None = None) -> torch.dtype | None:
    """--dtype -> torch.dtype. auto asks the device's probe and logs why; None when that is the CPU, where
    `models.loader.load_model` times decode steps of the loaded model in each candidate (models/autotune/dtype.py)."""
    if name != "auto":
        if name not in DTYPES:
            raise DeviceError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
        return DTYPES[name]
    answer = (probe or PROBES[device.type]).auto_dtype(device)
    if answer is None:
        return None
    dtype, reason = answer
    log.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), reason)
    return dtype


def dtype_name(dtype: torch.dtype | None) -> str:
    """'float32', 'bfloat16', 'float16'; 'auto' for None (the CPU's choice, made when the model loads)."""
    return "auto" if dtype is None else str(dtype).removeprefix("torch.")


def _usable(probe: DeviceProbe) -> bool:
    try:
        return probe.missing() is None
    except Exception as exc:  # a broken driver stack must not stop auto from falling back to the cpu
        log.warning("device %s probe failed: %s", probe.name, exc)
        return False
