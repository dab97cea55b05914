"""`--weight-format auto` for a GGUF on the CPU: time real decode steps of the quantized model against dense copies
of it, and keep quantized unless dense is clearly faster.

Quantized weights (engine/model/quant.py) keep the RAM near the file's size; dense float32 weights take 4 bytes per
parameter (about 5x a Q4 file) but run on the dense kernels, which may be faster on some CPUs and batch sizes. The
candidates: the quantized model as loaded, and dense copies built in memory from it (`densify`: each QuantLinear /
QuantEmbedding dequantized into an nn.Linear / nn.Embedding; nothing is written to disk): dense float32, and dense
bfloat16 when `--dtype auto` (the dtype probe's candidates, so the two choices stay one). An explicit `--dtype`
gives one dense candidate in that dtype. They are timed with the dtype probe's machinery (models/autotune/dtype.py:
`LLMEngine` decode steps at one row and at the configured concurrency, interleaved windows, the best kept).

The rule (`pick`): of the dense candidates, bfloat16 counts when it beats float32 by `BF16_MARGIN` (the dtype
probe's rule); that dense candidate is served when its throughput at the configured concurrency is at least
`DENSE_MARGIN` times the quantized one's and a lone request decodes about as fast on it (its one-row figure at
least `LONE_MARGIN` times the quantized one's: serving more streams must not cost the single user), else the
quantized model is. (On an AMD EPYC Zen 5, dense bfloat16 was 1.19-1.2x quantized at 16 rows and 0.49x at one:
before this condition, starts of the same server picked one or the other.) Dense candidates are only built when
the probe's peak (quantized weights, KV cache and every dense copy at once) fits in the free RAM:
`models.memory.auto_weight_formats`, also used by the preflight.

Nor where a dense copy cannot win (`out_of_reach`): a one-row decode step reads every linear weight once, so a dense
copy too big for the caches (`CACHED_BYTES`) decodes a lone request at most at the memory's read bandwidth over its
bytes. The quantized model is timed at one row first and the read bandwidth measured (`read_bandwidth`); a dense
dtype whose ceiling, with `READ_HEADROOM` to spare, is below `LONE_MARGIN` times the quantized figure could never be
served, so it is neither built nor timed (a 1B Q4_K_M file: 2.5 and 5 GB of copies and ~25 s no longer spent).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine.model.quant import QuantEmbedding, QuantLinear
from engine.types import EngineConfig
from models.autotune.bandwidth import read_bandwidth
from models.autotune.dtype import BF16_MARGIN, ProbePlan, Timing, bfloat16_copy, figures, measure

log = logging.getLogger(__name__)

DENSE_MARGIN = 1.2  # quantized keeps the RAM small: a dense copy is served only when >= 20% faster
LONE_MARGIN = 0.9  # ... and when a lone request decodes at >= 90% of quantized's speed on it (one row: timing noise)
READ_HEADROOM = 1.25  # dense one-row steps read at 0.88-0.98x torch's sum over a buffer (Zen 5); the host's moves
CACHED_BYTES = 256 << 20  # a dense copy smaller than this may sit in the caches: no bound from the memory's bandwidth
QUANTIZED = "quantized"


def dense_name(dtype: torch.dtype) -> str:
    return f"dense {str(dtype).removeprefix('torch.')}"


def choose(model: nn.Module, tokenizer: Any, cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
           max_model_len: int, dense: Iterable[torch.dtype], plan: ProbePlan | None = None,
           ) -> tuple[nn.Module, torch.dtype, str, str]:
    """The quantized `model` (activations in `dtype`) or a dense copy in one of the `dense` dtypes, whichever `pick`
    keeps, logged with the figures behind the choice: (model, dtype, the candidate's name, why)."""
    plan = plan or ProbePlan.for_config(cfg)
    start = time.perf_counter()
    dense, skipped = beyond_reach(model, tokenizer, cfg, device, dtype, max_model_len, list(dense), plan)
    if not dense:
        log.info("weight format auto: %s, timed in %.1f s (%s)", QUANTIZED, time.perf_counter() - start, skipped)
        return model, dtype, QUANTIZED, skipped
    models, dtypes = {QUANTIZED: model}, {QUANTIZED: dtype}
    for d in dense:  # bfloat16 beside float32: a cast of the float32 copy (dequantizing twice costs more)
        f32 = models.get(dense_name(torch.float32))
        copied = bfloat16_copy(f32) if d is torch.bfloat16 and f32 is not None else densify(model, d)
        models[dense_name(d)], dtypes[dense_name(d)] = copied, d
    timings = measure(models, tokenizer, cfg, device, max_model_len, plan, dtypes)
    name, reason = pick(timings, plan.rows[-1])
    reason = f"{reason}; {skipped}" if skipped else reason
    log.info("weight format auto: %s, timed in %.1f s (%s)", name, time.perf_counter() - start, reason)
    return models[name], dtypes[name], name, reason


def beyond_reach(model: nn.Module, tokenizer: Any, cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, dense: list[torch.dtype], plan: ProbePlan) -> tuple[list[torch.dtype], str]:
    """Of the `dense` dtypes, those a lone request could decode at `LONE_MARGIN` x quantized's speed on, and why the
    others are not tried: the quantized model's one-row step and the read bandwidth are measured only when a copy
    is too big for the caches."""
    big = {d: step_bytes(model, d) for d in dense}
    big = {d: n for d, n in big.items() if n >= CACHED_BYTES}
    if not big:
        return dense, ""
    [lone] = measure({QUANTIZED: model}, tokenizer, cfg, device, max_model_len, replace(plan, rows=(1,)),
                     {QUANTIZED: dtype})  # fmt: skip
    read = read_bandwidth()
    out = out_of_reach({dense_name(d): n for d, n in big.items()}, read, lone.tok_s)
    if not out:
        return dense, ""
    return [d for d in dense if dense_name(d) not in out], (
        f"{' and '.join(out)} not tried: quantized decodes one row at {lone.tok_s:.1f} tok/s "
        f"({lone.step_s * 1e3:.1f} ms/step), and {'; '.join(out.values())}")


def out_of_reach(step_bytes: dict[str, int], read: float, quantized_tok_s: float) -> dict[str, str]:
    """The dense candidates (name -> bytes a one-row step reads) that cannot decode one row at `LONE_MARGIN` x
    `quantized_tok_s` even at `READ_HEADROOM` x the measured `read` bandwidth (bytes/s), each with its arithmetic."""
    ceiling = {name: read * READ_HEADROOM / n for name, n in step_bytes.items()}
    return {name: f"a one-row step of {name} reads {n / 1e9:.2f} GB: at most {ceiling[name]:.1f} tok/s at "
                  f"{READ_HEADROOM:.2f}x the {read / 1e9:.1f} GB/s read here, under {LONE_MARGIN:.2f}x quantized's"
            for name, n in step_bytes.items() if ceiling[name] < LONE_MARGIN * quantized_tok_s}


def step_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The bytes a one-row decode step of `densify(model, dtype)` reads at least: every linear weight once (the LM
    head's too, a tied one once); an embedding only looks up a row."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        weight = module.qweight if isinstance(module, QuantLinear) else getattr(module, "weight", None)
        if isinstance(module, (QuantLinear, nn.Linear)) and id(weight) not in seen:
            seen.add(id(weight))
            total += weight.shape[0] * weight.shape[1]
    return total * torch.empty((), dtype=dtype).element_size()


def names(dense: Iterable[str]) -> tuple[str, ...]:
    """The candidates' names for dense dtypes given by name ("float32", "bfloat16"), quantized first."""
    return (QUANTIZED, *(dense_name(getattr(torch, d)) for d in dense))


def apply(model: nn.Module, choice: str, dtype: torch.dtype) -> tuple[nn.Module, torch.dtype]:
    """The model a remembered `choice` names, without timing: `model` itself (quantized) or its dense copy."""
    if choice == QUANTIZED:
        return model, dtype
    dense = getattr(torch, choice.removeprefix("dense "))
    return densify(model, dense), dense


def pick(timings: Iterable[Timing], rows: int, margin: float = DENSE_MARGIN) -> tuple[str, str]:
    """The candidate served (`QUANTIZED` or a `dense_name`) and why, with every figure: the dense candidate (bfloat16
    when >= BF16_MARGIN x float32, else float32) when its throughput at `rows` is >= `margin` x quantized's and a
    lone request decodes on it at >= LONE_MARGIN x quantized's speed (at one row, where timed)."""
    timings = list(timings)
    at = {t.name: t.tok_s for t in timings if t.rows == rows}
    alone = {t.name: t.tok_s for t in timings if t.rows == 1}
    f32, bf16 = dense_name(torch.float32), dense_name(torch.bfloat16)
    dense = f32 if f32 in at else None
    words = ""
    if bf16 in at:
        if dense is not None:
            faster = at[bf16] >= at[dense] * BF16_MARGIN
            words = f"{bf16} is{'' if faster else ' not'} >= {BF16_MARGIN:.2f}x {f32}, "
            dense = bf16 if faster else dense
        else:
            dense = bf16
    steps = f"decode steps of the loaded model, best window of each: {figures(timings, first=QUANTIZED)}"
    if dense is None:
        return QUANTIZED, steps
    wins = at[dense] >= at[QUANTIZED] * margin
    plural = "s" if rows > 1 else ""
    why = f"{steps}; {words}{dense} is{'' if wins else ' not'} >= {margin:.2f}x quantized at {rows} row{plural}"
    if wins and dense in alone and QUANTIZED in alone and alone[dense] < alone[QUANTIZED] * LONE_MARGIN:
        ratio = alone[dense] / alone[QUANTIZED]
        return QUANTIZED, f"{why}, but a lone request would decode slower on it ({ratio:.2f}x quantized at 1 row)"
    return (dense if wins else QUANTIZED), why


def densify(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A dense copy of a quantized model, in memory: each QuantLinear and QuantEmbedding dequantized (float32, then
    cast to `dtype`) into an nn.Linear / nn.Embedding, the other floating-point parameters cast to `dtype` as
    `dtype_probe.bfloat16_copy` does (shared when already in it); buffers shared. A LM head tied to the embedding
    (one QuantWeight) stays tied. `model` is left as it is."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    memo: dict[int, Any] = {id(b): b for b in model.buffers()}  # quantized blocks, RoPE frequencies: not copied
    for name, param in model.named_parameters():
        cast = param.is_floating_point() and param.dtype != dtype and not any(k in name.split(".") for k in keep)
        memo[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False) if cast else param
    dense: dict[int, nn.Parameter] = {}  # id(QuantWeight) -> its dequantized weight (a tied head: one copy)

    def weight(qweight: Any) -> nn.Parameter:
        if id(qweight) not in dense:
            dense[id(qweight)] = nn.Parameter(qweight.dequantize().to(dtype), requires_grad=False)
        return dense[id(qweight)]

    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            memo[id(module)] = embedding = nn.Embedding(*module.qweight.shape, device="meta", dtype=dtype)
            embedding.weight = weight(module.qweight)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            rows, cols = module.qweight.shape
            memo[id(module)] = linear = nn.Linear(cols, rows, bias=module.bias is not None, device="meta", dtype=dtype)
            linear.weight = weight(module.qweight)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach().to(dtype).clone(), requires_grad=False)
    copied = copy.deepcopy(model, memo)
    copied.config.dtype = dtype
    return copied.eval().requires_grad_(False)
