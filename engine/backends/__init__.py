"""Every device decision in one place: one Backend per kind of device (cpu.py, cuda.py, tt.py), picked from the
`BACKENDS` registry below; engine/backends/devices.py resolves a `--device` name through it.

Each kind has a probe (can it run here, which torch device, what `--dtype auto` picks) and a backend class, built
once per engine from the torch device and the engine's `KernelOptions`. Invariants every backend keeps:
- `free_memory_bytes()` is measured, not guessed: what the device could still hand out right now;
- `kernels(dtype)` is the kernel set (`engine.backends.kernels.Kernels`) the engine computes with, chosen once per
  engine: torch's ops unless the device has kernels of its own (and `KernelOptions.enabled`);
- `prepare(model, kernels)` returns the module the runner calls (the same one, moved or compiled as the device
  needs) and hands the kernel set's quantized-weight kernels to the model's quantized weights (`prepare_weights`);
- `forward_impl(asked)` is the forward pass the device runs ("generic" or "llama", engine/model/runner.py);
- `synchronize()` waits for queued work; the engine calls it only at boundaries, never per token;
- `load_kwargs()` / `place(model)`: how a loader puts freshly read weights on the device;
  `serves_quantized`: whether GGUF weights kept quantized (and `--quantize int8`) run here;
- `team_fills_cpus()`: whether the engine's thread team takes every CPU this process may use (the async front
  then hands the cores to the event loop between steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.backends.cpu import CpuBackend, CpuProbe
from engine.backends.cuda import CudaBackend, CudaProbe
from engine.backends.kernels import KernelOptions, Kernels
from engine.backends.tt import TTBackend, TtProbe


class DeviceProbe(Protocol):
    """Whether and how a kind of device runs here. `missing()`: None when it can, else a sentence naming exactly
    what is missing; `torch_device(index)`: the torch device that holds the model's tensors; `device_name(device)`:
    the resolved name `EngineConfig.device` carries ("cpu", "cuda:0", "tt"); `auto_dtype(device)`: the dtype
    `--dtype auto` picks, with the reason (logged), None on the CPU (timed on the loaded model by models/)."""

    name: str

    def missing(self) -> str | None: ...

    def torch_device(self, index: int | None) -> torch.device: ...

    def device_name(self, device: torch.device) -> str: ...

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str] | None: ...


class Backend(Protocol):
    name: str
    device: torch.device
    serves_quantized: bool

    def free_memory_bytes(self) -> int: ...

    def kernels(self, dtype: torch.dtype) -> Kernels: ...

    def prepare(self, model: torch.nn.Module, kernels: Kernels) -> torch.nn.Module: ...

    def prepare_weights(self, model: torch.nn.Module) -> None: ...

    def forward_impl(self, asked: str) -> str: ...

    def synchronize(self) -> None: ...

    def load_kwargs(self) -> dict[str, Any]: ...

    def place(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def team_fills_cpus(self) -> bool: ...


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device: whether and how it runs here (probe), and what runs on it (backend)."""

    probe: DeviceProbe
    backend: Callable[[torch.device, KernelOptions], Backend]


BACKENDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind(CpuProbe(), CpuBackend),
    "cuda": DeviceKind(CudaProbe(), CudaBackend),
    "tt": DeviceKind(TtProbe(), TTBackend),
}
