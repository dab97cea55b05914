"""scripts/bench_attention.py: decode attention timed alone prints its table and one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config import tool_cache_dir
from engine.backends import cpu_kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_attention.py"


@pytest.mark.timeout(600)
def test_bench_attention_reports_each_context_length() -> None:
    module = cpu_kernels.load(tool_cache_dir())
    if module is None:
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unsupported_reason()}")
    done = subprocess.run([sys.executable, str(SCRIPT), "--ctx", "40", "130", "--layers", "2", "--repeats", "2",
                           "--threads", "1"], capture_output=True, text=True, timeout=500, check=True)
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["isa"] == module.isa() and report["threads"] == 1 and report["kv_dtype"] == "float16"
    assert [r["ctx"] for r in report["rows"]] == [40, 130]
    # 2 layers x K and V x positions x 8 KV heads x 128 values x 2 bytes
    assert [r["kv_mb"] for r in report["rows"]] == [round(2 * 2 * n * 8 * 128 * 2 / 1e6, 1) for n in (40, 130)]
    for r in report["rows"]:
        assert r["ms"] > 0 and r["gb_s"] > 0
    assert "| 130 |" in done.stdout
