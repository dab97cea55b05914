"""Device backends behind one small interface; engine/backends/devices.py's registry (`DEVICES`) picks one per kind.

Invariants every backend keeps:
- `free_memory_bytes()` is measured, not guessed: what the device could still hand out right now;
- `prepare(model)` returns the module the runner calls (the same one, moved or compiled as the device needs);
- `synchronize()` waits for queued work; the engine calls it only at boundaries, never per token;
- `kernels(dtype, enabled, cache_dir)` is the kernel set the engine computes with (`engine.backends.kernels.Kernels`),
  chosen once per engine: torch's ops unless the device has kernels of its own.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

import torch

from engine.backends.kernels import TORCH, Kernels


class Backend(Protocol):
    name: str
    device: torch.device

    def free_memory_bytes(self) -> int: ...

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def synchronize(self) -> None: ...

    def kernels(self, dtype: torch.dtype, enabled: bool, cache_dir: Path | None) -> Kernels: ...


class CpuBackend:
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free_memory_bytes(self) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def synchronize(self) -> None:
        return None

    def kernels(self, dtype: torch.dtype, enabled: bool, cache_dir: Path | None) -> Kernels:
        """Peregrine's CPU kernels where they load and serve `dtype` (`enabled`: --cpu-kernels), else torch's."""
        from engine.backends import cpu_kernels

        return cpu_kernels.kernels_for(self.device, dtype, enabled, cache_dir)


class CudaBackend:
    """CUDA: free memory from the driver after the model is resident; no per-token host syncs in the engine
    beyond the sampler's one copy of the sampled ids."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} requested but torch.cuda.is_available() is False")
        self.device = device

    def free_memory_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def kernels(self, dtype: torch.dtype, enabled: bool, cache_dir: Path | None) -> Kernels:
        return TORCH


class TTBackend:
    """Tenstorrent devices through torch-ttnn (optional extra `peregrine[tt]`)."""

    name = "tt"

    def __init__(self, device: torch.device) -> None:
        missing = [m for m in ("ttnn", "torch_ttnn") if importlib.util.find_spec(m) is None]
        if missing:
            raise RuntimeError(
                f"device 'tt' needs the Python module(s) {', '.join(missing)}, which are not installed; "
                "install the optional extra with `pip install 'peregrine[tt]'` (torch-ttnn, which brings ttnn)"
            )
        self.device = device
        self._tt_device = None

    def free_memory_bytes(self) -> int:
        import psutil  # torch-ttnn keeps the KV cache in host tensors it moves per op

        return int(psutil.virtual_memory().available)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        import torch_ttnn
        import ttnn

        self._tt_device = ttnn.open_device(device_id=0)
        options = torch_ttnn.TorchTtnnOption(device=self._tt_device)
        return torch.compile(model, backend=torch_ttnn.backend, options=options)

    def synchronize(self) -> None:
        return None
