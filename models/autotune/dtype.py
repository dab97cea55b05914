"""`--dtype auto` on the CPU: time real decode steps of the loaded model in float32 and bfloat16, keep the faster.

Which dtype decodes faster depends on the CPU, on the kernels Peregrine has for it and on the batch. With
AVX512-BF16 or AMX, bfloat16 halves the bytes a step reads and wins; on an AVX2 CPU torch's bfloat16 matmuls
convert on the fly and, at 16 rows, run several times slower than float32. One matmul timed on its own cannot
tell these apart, so the probe times the engine itself: `LLMEngine.step` (scheduler, model runner with the kernels
chosen for the dtype, paged KV cache, sampler) over the loaded weights, at one row and at the configured
concurrency (`max_num_seqs`, at most 16), and keeps the dtype with the better throughput at the configured
concurrency. float32 is exact, so bfloat16 must beat it by `BF16_MARGIN`.

The weights are loaded once in float32; the bfloat16 candidate is a cast copy, and the loser is dropped, so the
peak is both copies (plus the packed copy AMX decode keeps): `models.memory.auto_cpu_dtypes` is that
arithmetic, used by the preflight before anything loads and by the loader to decide whether float32 is tried.
The probe is short: one-token prompts (so the first step is already a decode step: no prefill, whose per-sequence
attention calls cost more than the decode steps timed), a few decode steps, fewer when the answer is clear early.
The same machinery times `--weight-format auto` (models/autotune/weight_format.py).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.llm_engine import LLMEngine
from engine.model.kv_cache import KVCacheSpec, kv_cache_dtype
from engine.model.quant import is_quantized
from engine.types import EngineConfig, SamplingParams

log = logging.getLogger(__name__)

BF16_MARGIN = 1.1  # bfloat16 rounds, float32 is exact: bfloat16 is kept only when >= 10% faster
MAX_PROBE_ROWS = 16
QUIET_LOGGERS = ("engine.model.kv_cache", "engine.llm_engine", "engine.model.runner", "engine.backends.cpu_kernels")


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """What the probe runs: per row count, up to `repeats` windows of `steps` decode steps per dtype, interleaved
    across the dtypes (so a busy moment on a shared machine hits both), the best window kept. Windows stop early
    once the best figures are `settle` times apart: the answer is clear (settle > BF16_MARGIN), and on a CPU where
    one dtype is several times slower its steps are what the probe would spend its time on."""

    rows: tuple[int, ...]  # (1, the configured concurrency)
    prompt_tokens: int = 1  # one-token prompts: the first step is already a decode step (no prefill to pay for)
    steps: int = 1
    repeats: int = 3
    settle: float = 1.5

    @classmethod
    def for_config(cls, cfg: EngineConfig) -> ProbePlan:
        return cls(rows=tuple(sorted({1, max(1, min(cfg.max_num_seqs, MAX_PROBE_ROWS))})))


@dataclass(frozen=True, slots=True)
class Timing:
    """The best window of one dtype at one row count."""

    name: str  # the candidate: "float32", "bfloat16", or a weight format ("quantized", "dense float32")
    rows: int
    step_s: float  # seconds per decode step, best window
    steps: int  # decode steps timed, all windows

    @property
    def tok_s(self) -> float:
        return self.rows / self.step_s


def choose(model: torch.nn.Module, tokenizer: Any, cfg: EngineConfig, device: torch.device, max_model_len: int,
           plan: ProbePlan | None = None) -> tuple[torch.nn.Module, torch.dtype]:
    """The model in the faster dtype (`model` is the float32 load; the other candidate is a bfloat16 copy of it),
    logged with the figures behind the choice."""
    plan = plan or ProbePlan.for_config(cfg)
    start = time.perf_counter()
    models = {"float32": model, "bfloat16": bfloat16_copy(model)}
    timings = measure(models, tokenizer, cfg, device, max_model_len, plan)
    name, reason = pick(timings, plan.rows[-1])
    log.info("dtype auto: %s, timed in %.1f s (%s)", name, time.perf_counter() - start, reason)
    return models[name], getattr(torch, name)


def pick(timings: Iterable[Timing], rows: int, margin: float = BF16_MARGIN) -> tuple[str, str]:
    """bfloat16 when its throughput at `rows` is at least `margin` times float32's, else float32; with the
    figures of every timing in the reason."""
    timings = list(timings)
    at = {t.name: t.tok_s for t in timings if t.rows == rows}
    steps = f"decode steps of the loaded model, best window of each: {figures(timings, first='float32')}"
    verdict = "" if at["bfloat16"] >= at["float32"] * margin else " not"
    return ("float32" if verdict else "bfloat16"), (
        f"{steps}; bfloat16 is{verdict} >= {margin:.2f}x float32 at {_rows(rows)}")


def figures(timings: Iterable[Timing], first: str) -> str:
    """Every timing as "name 12.3 ms/step = 81.3 tok/s at 16 rows (3 steps)", by row count, `first` first."""
    ordered = sorted(timings, key=lambda t: (t.rows, t.name != first))
    return ", ".join(f"{t.name} {t.step_s * 1e3:.1f} ms/step = {t.tok_s:.1f} tok/s at {_rows(t.rows)} "
                     f"({t.steps} step{'s' if t.steps > 1 else ''})" for t in ordered)


def _rows(rows: int) -> str:
    return f"{rows} row{'s' if rows > 1 else ''}"


def measure(models: dict[str, torch.nn.Module], tokenizer: Any, cfg: EngineConfig, device: torch.device,
            max_model_len: int, plan: ProbePlan, dtypes: dict[str, torch.dtype] | None = None) -> list[Timing]:
    """Decode steps through a small `LLMEngine` per candidate (the serving code path, its own small KV cache).
    Each candidate runs in `dtypes[name]`, by default the dtype its name spells ("float32", "bfloat16")."""
    dtypes = dtypes or {name: getattr(torch, name) for name in models}
    engines = {name: probe_engine(m, tokenizer, cfg, device, dtypes[name], max_model_len, plan)
               for name, m in models.items()}
    timings = []
    for rows in plan.rows:
        for engine in engines.values():
            fill(engine, rows, plan)
        windows: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(plan.repeats):
            for name, engine in engines.items():
                windows[name].append(timed_window(engine, plan.steps))
            best = sorted(min(w) for w in windows.values())
            if best[-1] >= best[0] * plan.settle:
                break
        timings += [Timing(name, rows, min(w), plan.steps * len(w)) for name, w in windows.items()]
        for engine in engines.values():
            engine.abort_all()
    return timings


def probe_engine(model: torch.nn.Module, tokenizer: Any, cfg: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, plan: ProbePlan) -> LLMEngine:
    """An engine over `model` with room for the plan's sequences only, and no prefix caching."""
    rows = plan.rows[-1]
    tokens = plan.prompt_tokens + plan.steps * plan.repeats + 2  # prompt, warm-up step, timed steps
    context = -(-tokens // cfg.block_size) * cfg.block_size  # whole blocks: every row's fit at once
    kv = kv_cache_dtype(cfg.kv_cache_dtype, dtype, is_quantized(model))  # as the serving engine's (LLMEngine)
    kv_bytes = KVCacheSpec.from_hf_config(model.config, kv).bytes_per_token * rows * context
    small = replace(cfg, dtype=str(dtype).removeprefix("torch."), max_num_seqs=rows, kv_cache_bytes=kv_bytes,
                    prefix_caching=False, max_num_batched_tokens=max(cfg.max_num_batched_tokens, rows * tokens))
    with quiet(QUIET_LOGGERS):
        return LLMEngine(model, tokenizer, small, device, dtype, min(max_model_len, context))


@contextmanager
def quiet(names: Iterable[str]) -> Iterator[None]:
    """The probe engines' start lines (KV cache size, forward pass) would read as the serving engine's: warnings only."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def fill(engine: LLMEngine, rows: int, plan: ProbePlan) -> None:
    """`rows` greedy sequences, their prompts computed, untimed: with one-token prompts that is one decode-shaped
    step (the warm-up: it also builds the one-call decoder); longer prompts get a decode step after their prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=plan.steps * plan.repeats + 2, ignore_eos=True)
    vocab = engine.vocab_size
    for row in range(rows):
        engine.add_request(f"dtype-probe-{row}", [(7 + 13 * (row + i)) % vocab for i in range(plan.prompt_tokens)],
                           params)
    for _ in range(rows + plan.prompt_tokens):  # one step when the token budget allows; bounded in any case
        if not engine.scheduler.waiting and not any(seq.is_prefill for seq in engine.scheduler.running):
            break
        engine.step()
    if plan.prompt_tokens > 1:
        engine.step()
    if len(engine.scheduler.running) != rows:  # the KV cache above is sized for every row: a bug if not
        raise RuntimeError(f"dtype probe: {len(engine.scheduler.running)} of {rows} rows decoding")


def timed_window(engine: LLMEngine, steps: int) -> float:
    """Seconds per decode step over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def bfloat16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its floating-point parameters cast to bfloat16, as `from_pretrained(dtype=bfloat16)` loads it:
    buffers (RoPE's float32 frequencies) and the modules the model keeps in float32 stay as they are."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    memo: dict[int, Any] = {}
    for name, param in model.named_parameters():
        if param.is_floating_point() and not any(k in name.split(".") for k in keep):
            memo[id(param)] = torch.nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=False)
    copied = copy.deepcopy(model, memo)
    copied.config.dtype = torch.bfloat16
    return copied
