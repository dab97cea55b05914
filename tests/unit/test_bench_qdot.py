"""scripts/bench_qdot.py: the int8 matmul kernel timed alone prints its table and one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config import tool_cache_dir
from engine.backends import cpu_kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_qdot.py"


@pytest.mark.timeout(600)
def test_bench_qdot_reports_each_row_length() -> None:
    if cpu_kernels.load(tool_cache_dir()) is None:
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unsupported_reason()}")
    done = subprocess.run([sys.executable, str(SCRIPT), "--k", "64", "576", "--repeats", "1"], capture_output=True,
                          text=True, timeout=500, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["isa"] == cpu_kernels.load(tool_cache_dir()).isa() and report["threads"] == 1
    assert [r["k"] for r in report["results"]] == [64, 576]
    for r in report["results"]:
        assert r["rows"] >= 16 and r["ns_per_row"] > 0 and r["gb_s"] > 0
