"""Tenstorrent cards through torch-ttnn (optional extra `peregrine[tt]`), a torch.compile backend: tensors live on
the host (its torch device is the cpu, its name "tt") and compiled graphs run on the card. Its forward is always
the generic one (the Hugging Face model, compiled whole); its kernels are torch's ops, which torch-ttnn lowers."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from engine.backends.kernels import TORCH, KernelOptions, Kernels


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


class TTBackend:
    name = "tt"
    serves_quantized = False  # the quantized-weight kernels are CPU code

    def __init__(self, device: torch.device, opts: KernelOptions) -> None:
        missing = [m for m in ("ttnn", "torch_ttnn") if importlib.util.find_spec(m) is None]
        if missing:
            raise RuntimeError(
                f"device 'tt' needs the Python module(s) {', '.join(missing)}, which are not installed; "
                "install the optional extra with `pip install 'peregrine[tt]'` (torch-ttnn, which brings ttnn)"
            )
        self.device = device
        self.opts = opts
        self._tt_device = None

    def free_memory_bytes(self) -> int:
        import psutil  # torch-ttnn keeps the KV cache in host tensors it moves per op

        return int(psutil.virtual_memory().available)

    def kernels(self, dtype: torch.dtype) -> Kernels:
        return TORCH  # torch's ops: what torch-ttnn's compiler lowers onto the card

    def prepare(self, model: torch.nn.Module, kernels: Kernels) -> torch.nn.Module:
        import torch_ttnn  # type: ignore[import-not-found]
        import ttnn  # type: ignore[import-not-found]

        self._tt_device = ttnn.open_device(device_id=0)
        options = torch_ttnn.TorchTtnnOption(device=self._tt_device)
        return torch.compile(model, backend=torch_ttnn.backend, options=options)

    def prepare_weights(self, model: torch.nn.Module) -> None:
        return None

    def forward_impl(self, asked: str) -> str:
        """Always "generic": the compiled module is the Hugging Face model; the lean forward would call the
        uncompiled weights op by op on the host."""
        return "generic"

    def synchronize(self) -> None:
        return None

    def load_kwargs(self) -> dict[str, Any]:
        return {}

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # host tensors; prepare() compiles for the card

    def team_fills_cpus(self) -> bool:
        return False


def tt_device_count() -> int:
    """Tenstorrent cards ttnn can open (0 when ttnn cannot tell)."""
    import ttnn  # type: ignore[import-not-found]

    for getter in ("GetNumAvailableDevices", "get_num_devices"):
        if hasattr(ttnn, getter):
            return int(getattr(ttnn, getter)())
    return 0
