"""Which device and dtype the model runs on.

Device kinds are probed through a plain dict (`PROBES`); every probe answers three questions:
  - `missing()`: None when it can run here, else a sentence naming exactly what is missing;
  - `torch_device(index)`: the torch device that holds the model's tensors;
  - `auto_dtype(device)`: the dtype `--dtype auto` picks, with the reason (logged).

`tt` (Tenstorrent) runs through torch-ttnn, a torch.compile backend: tensors live on the host (cpu) and
compiled graphs run on the card, so its torch device is the cpu.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
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

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str]: ...


class CpuProbe:
    name = "cpu"

    def missing(self) -> str | None:
        return None

    def torch_device(self, index: int | None) -> torch.device:
        return torch.device("cpu")

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        return pick_cpu_dtype(*measure_cpu_matmul())


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


def resolve_dtype(name: str, device: torch.device, probe: DeviceProbe | None = None) -> torch.dtype:
    """--dtype -> torch.dtype. auto asks the device's probe (measured on CPU) and logs why."""
    if name != "auto":
        if name not in DTYPES:
            raise DeviceError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
        return DTYPES[name]
    probe = probe or probe_for(device)
    dtype, reason = probe.auto_dtype(device)
    log.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), reason)
    return dtype


def _usable(probe: DeviceProbe) -> bool:
    try:
        return probe.missing() is None
    except Exception as exc:  # a broken driver stack must not stop auto from falling back to the cpu
        log.warning("device %s probe failed: %s", probe.name, exc)
        return False


# --- CPU dtype measurement ----------------------------------------------------------------------------

BF16_MARGIN = 0.8  # bfloat16 loses precision, so it must be clearly faster (>= 1.25x) to be picked


def measure_cpu_matmul(tokens: int = 4, dim: int = 4096, repeats: int = 7) -> tuple[float, float]:
    """Best-of-N seconds of one decode-shaped matmul ([tokens, dim] x [dim, dim]) in float32 and bfloat16.

    Decode is memory-bound, so this reflects both the kernels (AVX512-BF16 / AMX make bfloat16 fast) and
    the halved bytes; the weight (64 MiB in float32) is larger than typical caches. The two dtypes run
    interleaved and the minimum is kept, which is robust to other processes sharing the cores.
    """
    runs = {dtype: _linear_runner(dtype, tokens, dim) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for dtype, run in runs.items():
            best[dtype] = min(best[dtype], _timed(run))
    return best[torch.float32], best[torch.bfloat16]


def _linear_runner(dtype: torch.dtype, tokens: int, dim: int) -> Callable[[], object]:
    x = torch.randn(tokens, dim, dtype=dtype)  # [tokens, dim]
    w = torch.randn(dim, dim, dtype=dtype)  # [out, in]
    torch.nn.functional.linear(x, w)  # warm up: the first call picks kernels
    return lambda: torch.nn.functional.linear(x, w)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pick_cpu_dtype(fp32_s: float, bf16_s: float) -> tuple[torch.dtype, str]:
    """bfloat16 when its measured matmul is clearly faster than float32, else float32 (exact)."""
    figures = f"matmul bfloat16 {bf16_s * 1e3:.2f} ms vs float32 {fp32_s * 1e3:.2f} ms"
    if bf16_s <= fp32_s * BF16_MARGIN:
        return torch.bfloat16, f"{figures}: bfloat16 is faster on this CPU"
    return torch.float32, f"{figures}: bfloat16 is not clearly faster on this CPU"
