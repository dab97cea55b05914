"""CUDA: free memory from the driver after the model is resident; torch's own kernels; no per-token host syncs in
the engine beyond the sampler's one copy of the sampled ids."""

from __future__ import annotations

from typing import Any

import torch

from engine.backends.errors import DeviceError
from engine.backends.kernels import TORCH, KernelOptions, Kernels


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


class CudaBackend:
    name = "cuda"
    serves_quantized = False  # the quantized-weight kernels are CPU code

    def __init__(self, device: torch.device, opts: KernelOptions) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} requested but torch.cuda.is_available() is False")
        self.device = device
        self.opts = opts

    def free_memory_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free)

    def kernels(self, dtype: torch.dtype) -> Kernels:
        return TORCH

    def prepare(self, model: torch.nn.Module, kernels: Kernels) -> torch.nn.Module:
        return model.to(self.device)

    def prepare_weights(self, model: torch.nn.Module) -> None:
        return None

    def forward_impl(self, asked: str) -> str:
        return asked

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def load_kwargs(self) -> dict[str, Any]:
        return {"device_map": {"": str(self.device)}}  # weights read straight onto the GPU

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # placed while loading (load_kwargs)

    def team_fills_cpus(self) -> bool:
        return False
