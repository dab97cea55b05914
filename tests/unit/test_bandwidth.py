"""scripts/bandwidth.py's hand-written read, now a tiny extension of its own (not part of the engine's kernels)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bandwidth.py"


def _script() -> object:
    spec = importlib.util.spec_from_file_location("bandwidth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_stream_read_sums_like_torch_and_the_engine_kernels_do_not_carry_it() -> None:
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        get_cxx_compiler()
    except RuntimeError as exc:
        pytest.skip(f"no C++ compiler: {exc}")
    reader = _script()._stream_read()
    assert reader is not None, "a compiler is present, so the read must build"
    x = torch.arange(64 * 1000, dtype=torch.float32) % 7  # small integers: the float sums are exact
    assert reader.stream_read(x) == float(x.double().sum())
    assert reader.isa() in ("avx512", "avx2", "scalar")
    with pytest.raises(RuntimeError, match="% 64"):
        reader.stream_read(torch.ones(65))
    from config import tool_cache_dir
    from engine.backends import cpu_kernels

    module = cpu_kernels.load(tool_cache_dir())
    assert module is None or not hasattr(module, "stream_read")
