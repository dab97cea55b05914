"""Device backends: chosen from a dict, measured free memory, a clear error when tt is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.backends import BACKENDS, get_backend


def test_cpu_backend_measures_free_memory() -> None:
    backend = get_backend(torch.device("cpu"))
    assert backend.name == "cpu" and backend.free_memory_bytes() > 0
    model = torch.nn.Linear(2, 2)
    assert backend.prepare(model) is model


def test_known_backends_and_unknown_device() -> None:
    assert set(BACKENDS) == {"cpu", "cuda", "tt"}
    with pytest.raises(ValueError, match="unknown device"):
        get_backend("mps")


@pytest.mark.skipif(importlib.util.find_spec("torch_ttnn") is not None, reason="torch-ttnn is installed here")
def test_tt_without_torch_ttnn_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match=r"torch_ttnn.*not installed.*peregrine\[tt\]"):
        get_backend("tt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="cuda"):
        get_backend(torch.device("cuda"))
