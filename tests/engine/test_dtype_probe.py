"""--dtype auto on the CPU: real decode steps of the loaded model decide between float32 and bfloat16.

The figures depend on the machine and on what else runs on it, so these tests check what was run and how the
answer follows from the figures, never how fast anything is.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.types import EngineConfig
from models import loader, memory, preflight
from models.autotune import dtype as dtype_probe
from models.autotune.dtype import ProbePlan, Timing
from tests.support import load_hf

SMALL = ProbePlan(rows=(1, 4), steps=2, repeats=2, settle=math.inf)  # every window, always


def timings(fp32_1: float, bf16_1: float, fp32_n: float, bf16_n: float, rows: int = 16) -> list[Timing]:
    """Timings with these tok/s figures at 1 row and at `rows`."""
    return [Timing("float32", 1, 1 / fp32_1, 6), Timing("bfloat16", 1, 1 / bf16_1, 6),
            Timing("float32", rows, rows / fp32_n, 6), Timing("bfloat16", rows, rows / bf16_n, 6)]


# --- the rule ----------------------------------------------------------------------------------------------


def test_the_configured_concurrency_decides_with_a_margin_for_float32() -> None:
    fast_bf16 = dtype_probe.pick(timings(10, 12, 100, 150), rows=16)
    close = dtype_probe.pick(timings(10, 12, 100, 105), rows=16)  # faster, not by the margin: exact float32
    slow_bf16 = dtype_probe.pick(timings(10, 30, 100, 40), rows=16)  # faster alone, slower where it counts
    at_one = dtype_probe.pick(timings(10, 30, 100, 40), rows=1)  # max_num_seqs 1: one row decides
    assert [fast_bf16[0], close[0], slow_bf16[0], at_one[0]] == ["bfloat16", "float32", "float32", "bfloat16"]
    margin = dtype_probe.BF16_MARGIN
    assert dtype_probe.pick(timings(10, 10, 100, 100 * margin * 1.01), rows=16)[0] == "bfloat16"
    assert dtype_probe.pick(timings(10, 10, 100, 100 * margin * 0.99), rows=16)[0] == "float32"
    assert dtype_probe.BF16_MARGIN > 1.0


def test_the_reason_carries_every_figure() -> None:
    _, reason = dtype_probe.pick(timings(12.5, 17.25, 39.0, 17.5), rows=16)
    for figure in ("float32 80.0 ms/step = 12.5 tok/s at 1 row (6 steps)", "bfloat16 58.0 ms/step = 17.2 tok/s at 1 row",
                   "float32 410.3 ms/step = 39.0 tok/s at 16 rows", "bfloat16 914.3 ms/step = 17.5 tok/s at 16 rows (6 steps)",
                   "bfloat16 is not >= 1.10x float32 at 16 rows"):
        assert figure in reason, reason


def test_the_plan_follows_max_num_seqs() -> None:
    cfg = EngineConfig(model_path="x", model_name="x")
    assert ProbePlan.for_config(cfg).rows == (1, min(cfg.max_num_seqs, 16))
    assert ProbePlan.for_config(EngineConfig(model_path="x", model_name="x", max_num_seqs=4)).rows == (1, 4)
    assert ProbePlan.for_config(EngineConfig(model_path="x", model_name="x", max_num_seqs=1)).rows == (1,)


# --- the probe on a real model -----------------------------------------------------------------------------


class StepCount:
    """Counts `LLMEngine.step` calls and the tokens they produce, per dtype."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: dict[torch.dtype, int] = {}
        self.tokens: dict[torch.dtype, int] = {}
        step = LLMEngine.step

        def counted(engine: LLMEngine) -> list:
            out = step(engine)
            self.steps[engine.dtype] = self.steps.get(engine.dtype, 0) + 1
            self.tokens[engine.dtype] = self.tokens.get(engine.dtype, 0) + len(out)
            return out

        monkeypatch.setattr(LLMEngine, "step", counted)


def probe_cfg(path: Any, **overrides: Any) -> EngineConfig:
    return EngineConfig(model_path=str(path), model_name="tiny", device="cpu", **overrides)


def test_the_probe_runs_decode_steps_of_the_loaded_model_in_both_dtypes(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = StepCount(monkeypatch)
    models = {"float32": tiny.model, "bfloat16": dtype_probe.bfloat16_copy(tiny.model)}
    got = dtype_probe.measure(models, tiny.tokenizer, probe_cfg("in-memory"), torch.device("cpu"),
                              tiny.max_model_len, SMALL)
    assert {(t.name, t.rows) for t in got} == {(d, r) for d in models for r in SMALL.rows}
    assert all(t.steps == SMALL.steps * SMALL.repeats and t.step_s > 0 and t.tok_s > 0 for t in got)
    # per row count and dtype: one step computing the one-token prompts (a decode step: the warm-up), then the timed
    # ones; a token per row each
    per_dtype = sum(1 + SMALL.steps * SMALL.repeats for _ in SMALL.rows)
    assert count.steps == {torch.float32: per_dtype, torch.bfloat16: per_dtype}
    tokens = sum(rows * (1 + SMALL.steps * SMALL.repeats) for rows in SMALL.rows)
    assert count.tokens == {torch.float32: tokens, torch.bfloat16: tokens}


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_the_probe_fits_every_row_with_a_kv_cache_wider_or_narrower_than_the_weights(tiny: Any, kv: str) -> None:
    """`--kv-cache-dtype float32` with the bfloat16 candidate: the probe's cache is sized in the cache's dtype (it
    was sized in the weights', so half the rows fit and the server refused to start: "8 of 16 rows decoding")."""
    from dataclasses import replace

    models = {"bfloat16": dtype_probe.bfloat16_copy(tiny.model)}
    got = dtype_probe.measure(models, tiny.tokenizer, replace(probe_cfg("in-memory"), kv_cache_dtype=kv),
                              torch.device("cpu"), tiny.max_model_len, SMALL)
    assert {(t.name, t.rows) for t in got} == {("bfloat16", r) for r in SMALL.rows}


def test_windows_stop_once_the_figures_are_clearly_apart(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    count = StepCount(monkeypatch)
    models = {"float32": tiny.model, "bfloat16": dtype_probe.bfloat16_copy(tiny.model)}
    plan = replace(SMALL, settle=1.0)  # any two figures are "apart": one window each
    got = dtype_probe.measure(models, tiny.tokenizer, probe_cfg("in-memory"), torch.device("cpu"),
                              tiny.max_model_len, plan)
    assert all(t.steps == plan.steps for t in got)
    assert count.steps == dict.fromkeys((torch.float32, torch.bfloat16), len(plan.rows) * (1 + plan.steps))


def test_choose_serves_the_dtype_with_the_better_measured_throughput(
    tiny: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    measured: list[Timing] = []
    measure = dtype_probe.measure
    monkeypatch.setattr(dtype_probe, "measure", lambda *a: measured.extend(measure(*a)) or measured)
    with caplog.at_level(logging.INFO, logger="models.autotune.dtype"):
        model, dtype = dtype_probe.choose(tiny.model, tiny.tokenizer, probe_cfg("in-memory"), torch.device("cpu"),
                                          tiny.max_model_len, SMALL)
    at = {t.name: t.tok_s for t in measured if t.rows == SMALL.rows[-1]}
    expected = torch.bfloat16 if at["bfloat16"] >= at["float32"] * dtype_probe.BF16_MARGIN else torch.float32
    assert dtype is expected and all(p.dtype is expected for p in model.parameters())
    assert (model is tiny.model) == (dtype is torch.float32)
    [line] = [r.message for r in caplog.records if r.message.startswith("dtype auto:")]
    assert re.match(rf"dtype auto: {str(dtype).removeprefix('torch.')}, timed in \d+\.\d s \(decode steps of the", line)
    assert len(re.findall(r"\d+\.\d tok/s at \d+ rows? \(4 steps\)", line)) == 4


def test_the_bfloat16_candidate_is_the_model_transformers_loads_in_bfloat16(tiny_model_dir: Any) -> None:
    copied = dtype_probe.bfloat16_copy(load_hf(tiny_model_dir.path, dtype="float32").model)
    direct = load_hf(tiny_model_dir.path, dtype="bfloat16").model
    ours, theirs = dict(copied.named_parameters()), dict(direct.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
    ours_b, theirs_b = dict(copied.named_buffers()), dict(direct.named_buffers())
    assert {k: b.dtype for k, b in ours_b.items()} == {k: b.dtype for k, b in theirs_b.items()}


# --- through the loader: the one place the dtype is decided --------------------------------------------------


def test_load_model_with_dtype_auto_times_and_serves_the_choice(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    count = StepCount(monkeypatch)
    with caplog.at_level(logging.INFO):  # engine.* and models.loader
        loaded = loader.load_model(probe_cfg(tiny_model_dir.path, dtype="auto", max_num_seqs=4))
    assert count.steps.keys() == {torch.float32, torch.bfloat16} and min(count.steps.values()) >= 2 * 2
    assert loaded.dtype in (torch.float32, torch.bfloat16)
    assert all(p.dtype is loaded.dtype for p in loaded.model.parameters())
    name = str(loaded.dtype).removeprefix("torch.")
    assert re.search(rf"dtype auto: {name}, timed in \d+\.\d s \(decode steps of the loaded model", caplog.text)
    assert "tok/s at 4 rows" in caplog.text and f"on cpu in {name}" in caplog.text


def test_an_explicit_dtype_times_nothing(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    count = StepCount(monkeypatch)
    monkeypatch.setattr(dtype_probe, "choose", lambda *a, **k: pytest.fail("an explicit dtype was timed"))
    with caplog.at_level(logging.INFO):  # engine.* and models.loader
        for name in ("float32", "bfloat16"):
            assert loader.load_model(probe_cfg(tiny_model_dir.path, dtype=name)).dtype is getattr(torch, name)
    assert count.steps == {} and "dtype auto" not in caplog.text


def test_float32_is_not_tried_when_the_probe_would_not_fit_in_ram(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fp = preflight.folder_footprint(tiny_model_dir.path)
    room = dict(max_model_len=None, kv_cache_bytes=None, packed_copy=preflight.packed_copy_kept("cpu", True))
    peak, _ = memory.memory_need(fp, "auto", **room)
    assert memory.memory_need(fp, "bfloat16", **room)[0] < peak
    monkeypatch.setattr(preflight, "measure_resources", lambda dirs: preflight.Resources(ram_free=peak - 1))
    monkeypatch.setattr(dtype_probe, "choose", lambda *a, **k: pytest.fail("float32 was timed"))
    with caplog.at_level(logging.INFO):  # engine.* and models.loader
        loaded = loader.load_model(probe_cfg(tiny_model_dir.path, dtype="auto"))
    assert loaded.dtype is torch.bfloat16
    assert "dtype auto: bfloat16 (float32 not tried: timing it needs" in caplog.text


def test_main_leaves_the_cpu_choice_to_the_loader_and_preflights_both_copies(
    tiny_model_dir: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from config import load_settings
    from models.acquire import acquire

    monkeypatch.chdir(tmp_path)  # no .env
    settings = load_settings(["--model", str(tiny_model_dir.path), "--device", "cpu", "--dtype", "auto",
                              "--embedding-model", "none", "--cache-dir", str(tmp_path)])
    with caplog.at_level(logging.INFO, logger="peregrine"):
        prepared = acquire(settings)
    assert prepared.dtype == "auto" and prepared.engine_config.dtype == "auto"
    assert "dtype auto (decode steps timed once loaded)" in caplog.text
    assert re.search(r"preflight: needs .* in float32 \+ KV cache .* bfloat16 copy timed by --dtype auto", caplog.text)


# --- the bundled model and the server -----------------------------------------------------------------------


@pytest.mark.slow
def test_the_probe_on_smollm2(smollm2_fp32: Any) -> None:
    """The bundled 135M model, kept short: one window of one step per dtype and row count."""
    plan = ProbePlan(rows=(1, 2), steps=1, repeats=1)
    models = {"float32": smollm2_fp32.model, "bfloat16": dtype_probe.bfloat16_copy(smollm2_fp32.model)}
    got = dtype_probe.measure(models, smollm2_fp32.tokenizer, probe_cfg("in-memory"), torch.device("cpu"),
                              smollm2_fp32.max_model_len, plan)
    assert len(got) == 4 and all(t.steps == 1 and t.tok_s > 0 for t in got)
    assert dtype_probe.pick(got, rows=2)[0] in ("float32", "bfloat16")


@pytest.mark.slow
def test_the_server_starts_with_dtype_auto(tiny_model_dir: Any, tmp_path: Any) -> None:
    import httpx

    from tests.api._tiny_server import TinyServer

    server = TinyServer(tiny_model_dir.path, tmp_path, "--dtype", "auto", "--max-num-seqs", "4",
                        "--log-level", "info")  # fmt: skip
    try:
        server.wait_ready()
        ready = httpx.get(f"{server.url}/ready", timeout=30).json()
    finally:
        server.stop()
    log = server.log_tail(100_000)
    assert ready["dtype"] in ("float32", "bfloat16"), ready
    assert re.search(rf"dtype auto: {ready['dtype']}, timed in [\d.]+ s \(decode steps of the loaded model", log), log
    assert "tok/s at 4 rows" in log and f"in {ready['dtype']}, max_model_len" in log, log
