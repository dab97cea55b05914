"""The CPU: the host's RAM, Peregrine's own kernels (engine/backends/cpu_kernels.py and quant_kernels.py, built
through the one loader in build.py, under the one ISA map and AMX decision of cpu_features.py), torch's ops for
the rest."""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.backends import cpu_features
from engine.backends.kernels import KernelOptions, Kernels


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


class CpuBackend:
    name = "cpu"
    serves_quantized = True  # GGUF weights kept quantized, --quantize int8: the quantized-weight kernels are CPU code

    def __init__(self, device: torch.device, opts: KernelOptions) -> None:
        self.device = device
        self.opts = opts
        cpu_features.ceiling(opts.isa)  # an unknown cap fails here, at start

    def free_memory_bytes(self) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    def kernels(self, dtype: torch.dtype) -> Kernels:
        """Peregrine's CPU kernels where they load and serve `dtype` (and --cpu-kernels is on), else torch's."""
        from engine.backends import cpu_kernels

        return cpu_kernels.kernels_for(dtype, self.opts)

    def prepare(self, model: torch.nn.Module, kernels: Kernels) -> torch.nn.Module:
        use_quant_kernels(model, kernels.quant)
        return model

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Hand the quantized-weight kernels to a freshly loaded model's quantized weights (None with
        --cpu-kernels off: they then use the portable reference), before anything multiplies by them."""
        from engine.backends import quant_kernels

        on = self.opts.enabled and self.opts.cache_dir is not None
        use_quant_kernels(model, quant_kernels.load(self.opts.cache_dir, cap=self.opts.isa) if on else None)

    def forward_impl(self, asked: str) -> str:
        return asked

    def synchronize(self) -> None:
        return None

    def load_kwargs(self) -> dict[str, Any]:
        return {}

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def team_fills_cpus(self) -> bool:
        """True when torch's thread team is as large as the CPUs this process may use."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return torch.get_num_threads() >= cpus

    def keeps_packed_copy(self) -> bool:
        """Whether the one-call decoder keeps a second, AMX-packed copy of bf16 weights (the preflight counts it)."""
        return keeps_packed_copy(self.opts)


def keeps_packed_copy(opts: KernelOptions) -> bool:
    """The decoder's AMX-packed bf16 copy is kept where the kernels are on and the AMX decision says yes."""
    return opts.enabled and cpu_features.amx(opts.isa)


def use_quant_kernels(model: torch.nn.Module, module: object | None) -> None:
    """Every quantized weight of `model` (engine.model.quant's modules carry one as `qweight`) computes with
    `module` (the quantized-weight kernels) from now on, or with the portable reference when None."""
    for sub in model.modules():
        weight = getattr(sub, "qweight", None)
        if weight is not None:
            weight.kernels = module
