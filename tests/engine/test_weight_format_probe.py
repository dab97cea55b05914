"""--weight-format auto for a GGUF on the CPU: the quantized model timed against dense copies built in memory.

Like tests/engine/test_dtype_probe.py, these check what was run and how the answer follows from the figures, never
how fast anything is. The GGUF is a tiny Llama written by the `gguf` package (tests/quant_blocks.py).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from config import DEFAULT_CACHE_DIR
from engine.model.quant import QuantEmbedding, QuantLinear, is_quantized
from engine.types import EngineConfig
from models import gguf_weights, loader, memory, preflight
from models.autotune import remembered
from models.autotune import weight_format as weight_format_probe
from models.autotune.dtype import BF16_MARGIN, ProbePlan, Timing
from models.autotune.weight_format import DENSE_MARGIN, LONE_MARGIN, densify, pick
from tests.quant_blocks import write_tiny_gguf

FORMATS = {"*": "Q4_1", "ffn_down": "Q8_0", "attn_v": "Q4_K"}  # mixed: fused and unfused projections
Q, F32, BF16 = "quantized", "dense float32", "dense bfloat16"


def timings(rows: int = 16, **tok_s: tuple[float, float]) -> list[Timing]:
    """Timings with these tok/s figures (at 1 row, at `rows`) per candidate: quantized=(10, 100), ..."""
    names = {"quantized": Q, "f32": F32, "bf16": BF16}
    return [Timing(names[k], r, r / v, 3) for k, (one, many) in tok_s.items() for r, v in ((1, one), (rows, many))]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, byte_level_tokenizer: Any) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("tiny-gguf")
    vocab = len(byte_level_tokenizer)
    return folder, write_tiny_gguf(folder, FORMATS, vocab=vocab + (-vocab) % 32)


def quantized(folder: Path) -> torch.nn.Module:
    return gguf_weights.load(folder / "tiny.gguf", folder, torch.float32)


# --- the rule ----------------------------------------------------------------------------------------------


def test_quantized_is_kept_unless_dense_is_faster_by_the_margin() -> None:
    assert pick(timings(quantized=(10, 100), f32=(12, 150)), rows=16)[0] == F32
    assert pick(timings(quantized=(10, 100), f32=(30, 110)), rows=16)[0] == Q  # faster, not by the margin
    assert pick(timings(quantized=(10, 100), f32=(10, 100 * DENSE_MARGIN * 1.01)), rows=16)[0] == F32
    assert pick(timings(quantized=(10, 100), f32=(9, 100 * DENSE_MARGIN * 0.99)), rows=16)[0] == Q
    assert pick(timings(quantized=(10, 100), f32=(30, 90)), rows=1)[0] == F32  # max_num_seqs 1: one row decides
    assert pick(timings(quantized=(10, 100)), rows=16) == (Q, pick(timings(quantized=(10, 100)), rows=16)[1])
    assert DENSE_MARGIN > 1.0


def test_dense_that_would_slow_a_lone_request_is_not_served() -> None:
    """Faster under load by the margin, but slower at one row (AMD EPYC Zen 5: dense bfloat16 1.2x quantized at 16
    rows, 0.49x at one): quantized, and the reason says why."""
    name, reason = pick(timings(quantized=(335, 769), bf16=(164, 769 * DENSE_MARGIN * 1.01)), rows=16)
    assert name == Q and "dense bfloat16 is >= 1.20x quantized at 16 rows" in reason
    assert "a lone request would decode slower on it (0.49x quantized at 1 row)" in reason
    assert pick(timings(quantized=(335, 769), bf16=(335, 769 * DENSE_MARGIN * 1.01)), rows=16)[0] == BF16  # no slower
    # within LONE_MARGIN at one row (timing noise on a near tie) still counts as no slower
    assert pick(timings(quantized=(335, 769), bf16=(335 * LONE_MARGIN * 1.01, 1000)), rows=16)[0] == BF16
    assert pick(timings(quantized=(335, 769), bf16=(335 * LONE_MARGIN * 0.99, 1000)), rows=16)[0] == Q


def test_bfloat16_counts_as_the_dense_candidate_by_the_dtype_probes_rule() -> None:
    # bfloat16 beats float32 by BF16_MARGIN: it is the dense candidate, and beats quantized by DENSE_MARGIN
    assert pick(timings(quantized=(10, 100), f32=(10, 110), bf16=(10, 110 * BF16_MARGIN * 1.05)), rows=16)[0] == BF16
    # bfloat16 faster than float32 but not by BF16_MARGIN: float32 is the dense candidate, and it is not fast enough
    name, reason = pick(timings(quantized=(10, 100), f32=(10, 110), bf16=(10, 118)), rows=16)
    assert name == Q and "dense bfloat16 is not >= 1.10x dense float32, dense float32 is not >= 1.20x quantized" \
        in reason
    assert pick(timings(quantized=(10, 100), bf16=(10, 130)), rows=16)[0] == BF16  # --dtype bfloat16: one candidate


def test_the_reason_carries_every_figure() -> None:
    _, reason = pick(timings(quantized=(20, 80), f32=(8, 40), bf16=(8, 16)), rows=16)
    for figure in ("quantized 50.0 ms/step = 20.0 tok/s at 1 row (3 steps)", "dense float32 125.0 ms/step = 8.0 tok/s",
                   "quantized 200.0 ms/step = 80.0 tok/s at 16 rows", "dense bfloat16 1000.0 ms/step = 16.0 tok/s at 16",
                   "dense float32 is not >= 1.20x quantized at 16 rows"):
        assert figure in reason, reason


def test_a_dense_copy_out_of_reach_at_one_row_is_not_tried() -> None:
    """A lone request on a dense copy too big for the caches decodes at most at the read bandwidth over its bytes:
    below LONE_MARGIN x quantized's one-row figure even with READ_HEADROOM, it could never be served."""
    reach, headroom = weight_format_probe.out_of_reach, weight_format_probe.READ_HEADROOM
    read = 40e9  # bytes/s
    steps = {BF16: 2_500_000_000, F32: 5_000_000_000}  # a 1.25B-weight step's bytes
    ceiling_bf16 = read * headroom / steps[BF16]
    out = reach(steps, read, quantized_tok_s=ceiling_bf16 / LONE_MARGIN * 1.01)
    assert list(out) == [BF16, F32]
    assert out[BF16] == (f"a one-row step of {BF16} reads 2.50 GB: at most {ceiling_bf16:.1f} tok/s at "
                         f"{headroom:.2f}x the 40.0 GB/s read here, under {LONE_MARGIN:.2f}x quantized's")
    assert list(reach(steps, read, quantized_tok_s=ceiling_bf16 / LONE_MARGIN * 0.99)) == [F32]
    assert reach(steps, read, quantized_tok_s=1.0) == {}  # a slow quantized model: the copies are timed


# --- the dense candidate -------------------------------------------------------------------------------------


def test_densify_dequantizes_every_weight_and_keeps_the_logits(tiny_gguf: tuple[Path, dict[str, Any]]) -> None:
    folder, reference = tiny_gguf
    model = quantized(folder)
    dense = densify(model, torch.float32)
    assert not is_quantized(dense) and is_quantized(model)  # the quantized model is left as it is
    assert dense.lm_head.weight is dense.model.embed_tokens.weight  # tied head: one dense copy
    state = dict(dense.named_parameters())
    for name, value in reference.items():  # dequantization is exact in float32
        assert torch.equal(state[name], torch.from_numpy(value)), name
    ids = torch.tensor([[3, 17, 250, 9, 44, 100, 301, 0]])
    with torch.inference_mode():
        got, want = dense(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))  # float32 sums' order
    half = densify(model, torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and half.config.dtype is torch.bfloat16
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in half.modules())


def test_step_bytes_count_every_linear_weight_once(tiny_gguf: tuple[Path, dict[str, Any]]) -> None:
    count = weight_format_probe.step_bytes
    model = quantized(tiny_gguf[0])
    dense = densify(model, torch.float32)
    linears = {id(m.weight): m.weight.numel() for m in dense.modules() if isinstance(m, torch.nn.Linear)}
    assert dense.lm_head.weight is dense.model.embed_tokens.weight  # the tied head is read, the lookup is not
    assert count(model, torch.float32) == 4 * sum(linears.values()) == 2 * count(model, torch.bfloat16)
    assert count(dense, torch.bfloat16) == count(model, torch.bfloat16)  # dense modules count alike


def test_read_bandwidth_is_a_measured_rate() -> None:
    read = weight_format_probe.read_bandwidth(nbytes=64 << 20, repeats=2)
    assert math.isfinite(read) and 1e8 < read < 1e14  # between 0.1 GB/s and 100 TB/s: bytes a second, measured


# --- through the loader ------------------------------------------------------------------------------------


@pytest.fixture
def gguf_cfg(tiny_gguf: tuple[Path, dict[str, Any]], byte_level_tokenizer: Any,
             monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """EngineConfig factory for the tiny GGUF, loaded quantized (its metadata folder is the test's own; the kernels
    are the ones built once in the default cache; the probe's remembered decisions are the test's own)."""
    folder, _ = tiny_gguf
    recall, remember = remembered.recall, remembered.remember
    monkeypatch.setattr(remembered, "recall", lambda cache, *a: recall(tmp_path / "decisions", *a))
    monkeypatch.setattr(remembered, "remember", lambda cache, *a: remember(tmp_path / "decisions", *a))

    def load(cfg: EngineConfig, device: torch.device, dtype: torch.dtype | None) -> tuple:
        dtype = dtype or torch.float32
        return gguf_weights.load(folder / "tiny.gguf", folder, dtype), byte_level_tokenizer, dtype, folder

    monkeypatch.setattr(loader, "load_quantized_gguf", load)
    return lambda **kw: EngineConfig(model_path=str(folder), model_name="tiny", gguf_file="tiny.gguf", device="cpu",
                                     cache_dir=str(DEFAULT_CACHE_DIR), **{"dtype": "auto", "max_num_seqs": 4} | kw)


def test_weight_format_auto_times_each_candidate_and_serves_the_choice(
    gguf_cfg: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plan = ProbePlan(rows=(1, 4), steps=1, repeats=2, settle=math.inf)
    choose = weight_format_probe.choose
    monkeypatch.setattr(weight_format_probe, "choose", lambda *a: choose(*a, plan=plan))
    with caplog.at_level(logging.INFO):
        loaded = loader.load_model(gguf_cfg())
    [line] = [r.message for r in caplog.records if r.message.startswith("weight format auto:")]
    name = re.match(r"weight format auto: (quantized|dense float32|dense bfloat16), timed in \d+\.\d s \(decode "
                    r"steps of the loaded model", line)[1]
    for candidate in (Q, F32, BF16):
        assert len(re.findall(rf"{candidate} \d+\.\d ms/step = \d+\.\d tok/s at (1 row|4 rows) \(2 steps\)", line)) \
            == 2, line
    assert is_quantized(loaded.model) == (name == Q)
    assert loaded.dtype is (torch.bfloat16 if name == BF16 else torch.float32)
    lone = r", but a lone request would decode slower on it \(\d+\.\d\dx quantized at 1 row\)"  # dense loses at 1 row
    assert re.search(rf"is( not)? >= {DENSE_MARGIN:.2f}x quantized at 4 rows({lone})?\)$", line), line


def test_the_decision_is_timed_once_per_file_and_machine(gguf_cfg: Any, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """The second start with the same file, CPU and settings serves what the first one timed, without timing; another
    concurrency (a different probe) times again; a remembered dense choice is served dense."""
    timed: list[int] = []
    choose = weight_format_probe.choose

    def counted(*a: Any) -> Any:
        timed.append(1)
        return choose(*a, plan=ProbePlan(rows=(1, 2), steps=1, repeats=1, settle=math.inf))

    monkeypatch.setattr(weight_format_probe, "choose", counted)
    first = loader.load_model(gguf_cfg())
    [kept] = list((tmp_path / "decisions" / "autotune").glob("weight-format-*.json"))
    with caplog.at_level(logging.INFO):
        again = loader.load_model(gguf_cfg())
    assert len(timed) == 1 and is_quantized(again.model) == is_quantized(first.model)
    assert again.dtype is first.dtype
    assert "as timed on this CPU for this file at" in caplog.text and str(kept) in caplog.text
    loader.load_model(gguf_cfg(max_num_seqs=2))
    assert len(timed) == 2
    kept.write_text(kept.read_text().replace('"choice": "quantized"', '"choice": "dense bfloat16"')
                    .replace('"choice": "dense float32"', '"choice": "dense bfloat16"'))
    dense = loader.load_model(gguf_cfg())
    assert len(timed) == 2 and not is_quantized(dense.model) and dense.dtype is torch.bfloat16
    kept.write_text("not json")  # a damaged file: timed again, then rewritten
    loader.load_model(gguf_cfg())
    assert len(timed) == 3 and '"choice"' in kept.read_text()


def test_explicit_weight_formats_time_nothing(gguf_cfg: Any, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(weight_format_probe, "choose", lambda *a, **k: pytest.fail("an explicit format was timed"))
    with caplog.at_level(logging.INFO):
        assert is_quantized(loader.load_model(gguf_cfg(weight_format="quantized")).model)
    assert "weight format auto" not in caplog.text
    assert not loader.serves_quantized_gguf(gguf_cfg(weight_format="dense"), torch.device("cpu"))  # converted


def test_dense_is_tried_only_where_it_fits_in_ram(gguf_cfg: Any, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    tried: list[tuple[torch.dtype, ...]] = []
    monkeypatch.setattr(weight_format_probe, "choose", lambda m, t, c, d, dt, n, dense: tried.append(tuple(dense))
                        or (m, dt, Q, "not timed"))  # fmt: skip
    cfg = gguf_cfg()
    fp = preflight.gguf_footprint(Path(cfg.model_path) / "tiny.gguf", cached=True, quantized=True)
    room = dict(max_model_len=None, kv_cache_bytes=None, packed_copy=preflight.packed_copy_kept("cpu", True))
    with_bf16, _ = memory.memory_need(fp, "float32", dense=("bfloat16",), **room)
    both, _ = memory.memory_need(fp, "float32", dense=("float32", "bfloat16"), **room)
    for ram in (both, both - 1, with_bf16 - 1):
        monkeypatch.setattr(preflight, "measure_resources", lambda dirs, ram=ram: preflight.Resources(ram_free=ram))
        with caplog.at_level(logging.INFO):
            assert is_quantized(loader.load_model(cfg).model)
    assert tried == [(torch.float32, torch.bfloat16), (torch.bfloat16,)]
    assert "weight format auto: dense float32 not tried: timing it needs" in caplog.text
    assert "weight format auto: quantized (dense float32 and bfloat16 not tried: timing it needs" in caplog.text
    tried.clear()
    monkeypatch.setattr(preflight, "measure_resources", lambda dirs: preflight.Resources(ram_free=both))
    loader.load_model(gguf_cfg(dtype="float32"))  # an explicit dtype: one dense candidate, in it
    assert tried == [(torch.float32,)]


def test_main_preflights_the_dense_copies_only_with_weight_format_auto(
    tiny_gguf: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from config import load_settings
    from models.acquire import acquire

    folder, _ = tiny_gguf
    monkeypatch.chdir(tmp_path)  # no .env
    for fmt in ("auto", "quantized"):
        settings = load_settings(["--model", str(folder / "tiny.gguf"), "--device", "cpu", "--dtype", "auto",
                                  "--weight-format", fmt, "--embedding-model", "none", "--cache-dir", str(tmp_path)])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="peregrine"):
            acquire(settings)
        [line] = [r.message for r in caplog.records if r.message.startswith("preflight: needs") and "in RAM" in r.message]
        assert line.startswith("preflight: needs") and "quantized (GGUF tensors)" in line
        copies = "dense float32 copy if --weight-format auto times it + " in line and "dense bfloat16 copy" in line
        assert copies == (fmt == "auto"), line


def test_copies_out_of_reach_are_neither_built_nor_timed(gguf_cfg: Any, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """The tiny model's copies fit in any cache, so here CACHED_BYTES is lowered and the bandwidth given (a stand-in
    for a slow memory): the quantized model is timed at one row, no dense copy is built, the decision and its
    arithmetic are remembered; with bandwidth to spare, the copies are built and timed as before."""
    plan = ProbePlan(rows=(1, 4), steps=1, repeats=1, settle=math.inf)
    choose = weight_format_probe.choose
    monkeypatch.setattr(weight_format_probe, "choose", lambda *a: choose(*a, plan=plan))
    monkeypatch.setattr(weight_format_probe, "CACHED_BYTES", 0)
    built: list[torch.dtype] = []
    monkeypatch.setattr(weight_format_probe, "densify", lambda m, d: built.append(d) or densify(m, d))
    monkeypatch.setattr(weight_format_probe, "read_bandwidth", lambda: 1e3)  # 1 kB/s: no copy can keep up
    with caplog.at_level(logging.INFO):
        loaded = loader.load_model(gguf_cfg())
    assert is_quantized(loaded.model) and built == []
    [line] = [r.message for r in caplog.records if r.message.startswith("weight format auto:")]
    assert re.match(rf"weight format auto: quantized, timed in \d+\.\d s \({F32} and {BF16} not tried: quantized "
                    r"decodes one row at \d+\.\d tok/s \(\d+\.\d ms/step\), and a one-row step of dense float32 reads "
                    r"0\.\d\d GB: at most 0\.0 tok/s at 1\.25x the 0\.0 GB/s read here", line), line
    [kept] = list((tmp_path / "decisions" / "autotune").glob("weight-format-*.json"))
    assert '"choice": "quantized"' in kept.read_text() and "not tried: quantized decodes one row" in kept.read_text()
    kept.unlink()
    monkeypatch.setattr(weight_format_probe, "read_bandwidth", lambda: 1e15)  # every copy within reach: timed
    caplog.clear()
    with caplog.at_level(logging.INFO):
        loader.load_model(gguf_cfg())
    assert built == [torch.float32]  # bfloat16: a cast of the float32 copy
    assert "not tried" not in caplog.text and f"{BF16} " in caplog.text
