"""Which device and dtype the model runs on.

Device kinds are probed through a plain dict (`PROBES`); every probe answers three questions:
  - `missing()`: None when it can run here, else a sentence naming exactly what is missing;
  - `torch_device(index)`: the torch device that holds the model's tensors;
  - `auto_dtype(device)`: the dtype `--dtype auto` picks, with the reason (logged); None on the CPU, where
    the loader times decode steps of the loaded model in each candidate dtype (engine/dtype_probe.py).

`tt` (Tenstorrent) runs through torch-ttnn, a torch.compile backend: tensors live on the host (cpu) and
compiled graphs run on the card, so its torch device is the cpu.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Protocol

import torch

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

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str] | None: ...


class CpuProbe:
    name = "cpu"

    def missing(self) -> str | None:
        return None

    def torch_device(self, index: int | None) -> torch.device:
        return torch.device("cpu")

    def auto_dtype(self, device: torch.device) -> None:
        return None  # decided on the loaded model: engine/dtype_probe.py


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

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        return torch.bfloat16, "Tenstorrent cards compute in bfloat16"


PROBES: dict[str, DeviceProbe] = {"cpu": CpuProbe(), "cuda": CudaProbe(), "tt": TtProbe()}


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


def probe_for(device: torch.device) -> DeviceProbe:
    """The probe of a resolved torch device (cpu or cuda; tt's host device is the cpu)."""
    return PROBES[device.type]


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
    `engine.loader.load_model` times decode steps of the loaded model in each candidate (engine/dtype_probe.py)."""
    if name != "auto":
        if name not in DTYPES:
            raise DeviceError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
        return DTYPES[name]
    answer = (probe or probe_for(device)).auto_dtype(device)
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
