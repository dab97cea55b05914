"""Device backends: chosen through the one device registry, measured free memory, a clear error when tt is
missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.backends import devices
from engine.backends.devices import DEVICES, backend_for


def test_cpu_backend_measures_free_memory() -> None:
    backend = backend_for("cpu", torch.device("cpu"))
    assert backend.name == "cpu" and backend.free_memory_bytes() > 0
    model = torch.nn.Linear(2, 2)
    assert backend.prepare(model) is model


def test_one_registry_and_unknown_device() -> None:
    assert set(DEVICES) == {"cpu", "cuda", "tt"} and devices.PROBES["tt"] is DEVICES["tt"].probe
    assert backend_for("auto", torch.device("cpu")).name == "cpu"  # an unresolved config: by the torch device
    with pytest.raises(devices.DeviceError, match="unknown device"):
        backend_for("mps", torch.device("cpu"))


def test_resolved_names_are_translated_not_probed() -> None:
    assert devices.kind_of("cuda:1") == "cuda" and devices.kind_of("tt") == "tt"
    assert devices.cuda_index("cuda") == 0 and devices.cuda_index("cuda:2") == 2 and devices.cuda_index("tt") is None
    assert devices.placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert devices.placement("tt", "bfloat16")[0] == torch.device("cpu")  # host tensors; the card runs graphs
    assert devices.resolve("cpu", "auto") == devices.Resolved("cpu", "auto")  # the CPU's auto: timed when loaded


@pytest.mark.skipif(importlib.util.find_spec("torch_ttnn") is not None, reason="torch-ttnn is installed here")
def test_tt_without_torch_ttnn_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match=r"torch_ttnn.*not installed.*peregrine\[tt\]"):
        backend_for("tt", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="cuda"):
        backend_for("cuda", torch.device("cuda"))
