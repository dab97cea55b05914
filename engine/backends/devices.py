"""Which device and dtype the model runs on: the one registry of device kinds (cpu, cuda, tt).

`DEVICES` maps each kind to a `DeviceKind`: its probe and its backend (engine/backends/device_backends.py), whose `kernels()`
is the kernel set (engine/backends/kernels.py) the model runner computes with. Every probe answers four questions:
  - `missing()`: None when it can run here, else a sentence naming exactly what is missing;
  - `torch_device(index)`: the torch device that holds the model's tensors;
  - `device_name(device)`: the resolved name `EngineConfig.device` carries ("cpu", "cuda:0", "tt");
  - `auto_dtype(device)`: the dtype `--dtype auto` picks, with the reason (logged); None on the CPU, where
    the loader times decode steps of the loaded model in each candidate dtype (models/autotune/dtype.py).

The device and dtype are resolved once (`resolve`, called by main.py, or on a Ray replica by the loader
when its config still says "auto"); `EngineConfig` carries the result and the rest only translates it.

`tt` (Tenstorrent) runs through torch-ttnn, a torch.compile backend: tensors live on the host (cpu) and
compiled graphs run on the card, so its torch device is the cpu and its name is "tt".
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.backends.device_backends import Backend, CpuBackend, CudaBackend, TTBackend

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class DeviceError(RuntimeError):
    """The requested device or dtype cannot be used here. The message says why, for the user."""


class DeviceProbe(Protocol):
    name: str

    def missing(self) -> str | None: ...

    def torch_device(self, index: int | None) -> torch.device: ...

    def device_name(self, device: torch.device) -> str: ...

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str] | None: ...


class CpuProbe:
    name = "cpu"

    def missing(self) -> str | None:
        return None

    def torch_device(self, index: int | None) -> torch.device:
        return torch.device("cpu")

    def device_name(self, device: torch.device) -> str:
        return "cpu"

    def auto_dtype(self, device: torch.device) -> None:
        return None  # decided on the loaded model: models/autotune/dtype.py


class CudaProbe:
    name = "cuda"

    def missing(self) -> str | None:
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU-only build (reinstall torch with CUDA support)"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        return None

    def torch_device(self, index: int | None) -> torch.device:
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if index is None else index
        if index >= count:
            raise DeviceError(f"cuda:{index} requested but only {count} CUDA device(s) are visible")
        return torch.device("cuda", index)

    def device_name(self, device: torch.device) -> str:
        return str(device)

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"{torch.cuda.get_device_name(device)} supports bfloat16"
        return torch.float16, f"{torch.cuda.get_device_name(device)} has no bfloat16"


class TtProbe:
    name = "tt"

    def missing(self) -> str | None:
        for module, package in (("torch_ttnn", "torch-ttnn"), ("ttnn", "ttnn")):
            if importlib.util.find_spec(module) is None:
                return f"the {module} package is not installed (pip install {package})"
        if tt_device_count() == 0:
            return "no Tenstorrent device found (ttnn sees no card; check /dev/tenstorrent and tt-smi)"
        return None

    def torch_device(self, index: int | None) -> torch.device:
        return torch.device("cpu")

    def device_name(self, device: torch.device) -> str:
        return "tt"  # its torch device is the host's

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        return torch.bfloat16, "Tenstorrent cards compute in bfloat16"


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device: whether and how it runs here (probe), and what runs on it (backend; the backend's
    `kernels()` is the kernel set the model runner computes with)."""

    probe: DeviceProbe
    backend: Callable[[torch.device], Backend]


DEVICES: dict[str, DeviceKind] = {
    "cpu": DeviceKind(CpuProbe(), CpuBackend),
    "cuda": DeviceKind(CudaProbe(), CudaBackend),
    "tt": DeviceKind(TtProbe(), TTBackend),
}
PROBES: dict[str, DeviceProbe] = {kind: entry.probe for kind, entry in DEVICES.items()}


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


def backend_for(device: str, torch_dev: torch.device) -> Backend:
    """The backend for an engine on `torch_dev`: by the configured kind ("tt" runs from host tensors), or by
    the torch device's type when the config says "auto"."""
    kind = parse_device(device)[0]
    return DEVICES[torch_dev.type if kind == "auto" else kind].backend(torch_dev)


def kind_of(device: str) -> str:
    """'cuda:1' -> 'cuda', 'tt' -> 'tt', 'auto' -> 'auto'."""
    return parse_device(device)[0]


def cuda_index(device: str) -> int | None:
    """The CUDA device index of a resolved name ('cuda' is 0), None for any other kind."""
    kind, index = parse_device(device)
    return (index or 0) if kind == "cuda" else None


def tt_device_count() -> int:
    """Tenstorrent cards ttnn can open (0 when ttnn cannot tell)."""
    import ttnn  # type: ignore[import-not-found]

    for getter in ("GetNumAvailableDevices", "get_num_devices"):
        if hasattr(ttnn, getter):
            return int(getattr(ttnn, getter)())
    return 0


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
