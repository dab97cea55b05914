"""scripts/bench_isa.py without running an engine: which levels it compares on a CPU's flags, the cores it pins two
threads to, and the table of one run per level with each level against the first."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_isa  # noqa: E402

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
SAPPHIRE_RAPIDS = AVX512 | {"avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(("flags", "levels"), [
    (AVX2, ["avx2"]),  # Zen 3
    (AVX2 | {"avx512f", "avx512bw", "avx512vl"}, ["avx2"]),  # Skylake-SP: AVX-512 without VNNI runs avx2
    (AVX512, ["avx2", "avx512"]),  # Cascade Lake, Ice Lake
    (SAPPHIRE_RAPIDS, ["avx2", "avx_vnni", "avx512", "avx512_bf16"]),  # amx: avx512_bf16's build, not twice
])
def test_the_levels_compared_are_the_builds_a_cpu_runs(flags: frozenset[str], levels: list[str]) -> None:
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("the x86 levels")
    assert bench_isa.kernel_levels(flags) == levels
    amx = ["amx"] if "amx_int8" in flags else []  # compared besides: its decode steps of 9 rows on the int8 tiles
    assert bench_isa.compared_levels(flags) == levels + amx


def test_two_threads_get_two_cores_where_there_are() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    spread = bench_isa.spread(cpus)
    assert sorted(spread) == cpus  # every CPU, each once
    prefix, env = bench_isa.environment(2)
    assert prefix[:2] == ["taskset", "-c"] and prefix[2] == ",".join(map(str, spread[:2])) and env["OMP_NUM_THREADS"] == "2"
    assert bench_isa.environment(0) == ([], dict(os.environ))


def test_the_table_sets_each_level_against_the_first(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def run(one: float, sixteen: float, batch1: float, percent: float) -> dict:
        return {"model": "m.gguf", "prompt_len": 128, "output_len": 128, "output_tok_s": {"1": one, "16": sixteen},
                "batch1_decode_tok_s": batch1, "batch1_bytes_per_token": {"weights": 96_000_000},
                "batch1_roofline": {"weights": {"percent": percent}}}

    runs = {"avx2": run(100.0, 200.0, 150.0, 50.0), "avx512": run(150.0, 210.0, 165.0, 55.0)}
    bw = {"threads": 2, "gb_per_s": {"read": 20.0, "read_simd": 28.8}}
    args = argparse.Namespace(json=tmp_path / "isa.json")
    bench_isa.report(["avx2", "avx512"], runs, [1, 16], bw, 28.8, args)
    table = capsys.readouterr().out
    assert "| avx512 | 150.0 | 210.0 | 165.0 | 55.0% | 1.50x, 1.05x, 1.10x |" in table
    assert "| avx2 | 100.0 | 200.0 | 150.0 | 50.0% | 1.00x, 1.00x, 1.00x |" in table
    assert "best read 28.8 GB/s (2 threads)" in table and "96.0 MB of weights" in table
    rows = json.loads((tmp_path / "isa.json").read_text())["rows"]
    assert [row["level"] for row in rows] == ["avx2", "avx512"] and rows[1]["ratios"] == [1.5, 1.05, 1.1]
