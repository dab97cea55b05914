"""The one memory arithmetic: what a model needs in RAM or VRAM, for the preflight (models/preflight.py), the
load-time probes' room (models/loader.py) and the several-models KV sizing (serving/start.py).

Memory is weights in the serving dtype plus the smallest useful KV cache: one sequence of the full context (or
the explicit --kv-cache-bytes when larger), plus the copies the load-time probes time beside them. The bytes of
a dtype and of one token's K and V come from the engine (`engine.types.DTYPE_BYTES`,
`engine.types.kv_bytes_per_token`, what the KV cache is sized with), so the preflight counts what the engine
allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import types as engine_types
from engine.types import DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class KVShape:
    """The attention shape the KV cache follows: layers, KV heads, head size."""

    layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What serving a model needs, from its metadata (models/preflight.py reads it)."""

    param_count: int  # weights, in elements
    kv: KVShape
    context_len: int  # the model's own context length
    download_bytes: int = 0  # files still to fetch from the Hub
    convert_bytes: int = 0  # dense float32 weights a first GGUF conversion writes to the cache
    weight_bytes: int | None = None  # resident weights when they do not follow the dtype (a GGUF kept quantized)


def fmt_bytes(n: int | float) -> str:
    """Decimal units, one decimal: 16_100_000_000 -> '16.1 GB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def dtype_bytes(name: str, default: int | None = None) -> int:
    """Bytes per element of dtype `name` ("float32", "bfloat16", "float16"), from the engine's dtype table;
    `default` for a name it does not know (a checkpoint's torch_dtype), else KeyError."""
    if name not in DTYPE_BYTES and default is not None:
        return default
    return DTYPE_BYTES[name]


def kv_bytes_per_token(kv: KVShape, dtype: str) -> int:
    """One token's K and V over every layer, in `dtype`: the engine's own formula."""
    return engine_types.kv_bytes_per_token(kv.layers, kv.kv_heads, kv.head_dim, dtype)


def kv_cache_need(fp: ModelFootprint, kv_dtype: str, max_model_len: int | None, kv_cache_bytes: int | None) -> int:
    """The smallest KV cache that holds one sequence of the full context, or the explicit size if larger."""
    tokens = max_model_len or fp.context_len
    return max(kv_bytes_per_token(fp.kv, kv_dtype) * tokens, kv_cache_bytes or 0)


def kv_cache_stored(dtype: str, kv_dtype: str, quantized: bool = False) -> str:
    """The KV cache's dtype for weights served in `dtype` ("auto": float32, the widest the probes keep) and
    `--kv-cache-dtype kv_dtype` (auto: the weights' dtype, float16 for float32 activations over `quantized` weights:
    engine.types.kv_dtype_for)."""
    return engine_types.kv_dtype_for(kv_dtype, "float32" if dtype == "auto" else dtype, quantized)


def memory_need(
    fp: ModelFootprint, dtype: str, *, max_model_len: int | None, kv_cache_bytes: int | None,
    packed_copy: bool = False, dense: tuple[str, ...] = (), kv_dtype: str = "auto",
) -> tuple[int, str]:
    """Bytes for weights in `dtype` + KV cache (+ the one-call decode step's packed copy of the bfloat16 weights,
    which it keeps on CPUs with AMX), with the breakdown in words. dtype "auto" (CPU) is the peak of the
    `--dtype auto` probe (models/autotune/dtype.py): float32 weights and KV cache + the bfloat16 copy timed beside
    them. `dense`: the dense copies `--weight-format auto` times beside quantized weights
    (models/autotune/weight_format.py). `kv_dtype`: `--kv-cache-dtype` (auto: the KV cache in the weights' dtype)."""
    if fp.weight_bytes is not None and dtype == "auto":
        dtype = "float32"  # quantized weights: activations in float32 (KV cache in float16), no dtype probe
    stored = "float32" if dtype == "auto" else dtype
    weights = fp.param_count * dtype_bytes(stored) if fp.weight_bytes is None else fp.weight_bytes
    kv_stored = kv_cache_stored(stored, kv_dtype, quantized=fp.weight_bytes is not None)
    kv = kv_cache_need(fp, kv_stored, max_model_len, kv_cache_bytes)
    tokens = max_model_len or fp.context_len
    kv_words = f"KV cache {fmt_bytes(kv)}" + (
        "" if kv_cache_bytes and kv_cache_bytes >= kv else f" for {tokens} tokens"
    ) + ("" if kv_stored == stored else f" in {kv_stored}")
    bf16 = fp.param_count * dtype_bytes("bfloat16")
    probe = bf16 if dtype == "auto" else 0
    probe_words = f" + {fmt_bytes(probe)} bfloat16 copy timed by --dtype auto" if probe else ""
    copy = bf16 if packed_copy and dtype in ("auto", "bfloat16") else 0
    copy_words = f" + {fmt_bytes(copy)} packed copy for AMX decode steps" if copy else ""
    held = f"in {stored}" if fp.weight_bytes is None else "quantized (GGUF tensors)"
    timed = {d: fp.param_count * dtype_bytes(d) + (bf16 if packed_copy and d == "bfloat16" else 0) for d in dense}
    timed_words = "".join(f" + {fmt_bytes(n)} dense {d} copy if --weight-format auto times it"  # not where it cannot win
                          for d, n in timed.items())
    return weights + kv + probe + copy + sum(timed.values()), (
        f"weights {fmt_bytes(weights)} {held} + {kv_words}{probe_words}{copy_words}{timed_words}")


def auto_cpu_dtypes(
    fp: ModelFootprint, ram_free: int, *, max_model_len: int | None, kv_cache_bytes: int | None,
    packed_copy: bool = False, kv_dtype: str = "auto",
) -> tuple[tuple[str, ...], str]:
    """The dtypes `--dtype auto` times on the CPU, and why float32 is left out when it is: both when the probe's
    peak (`memory_need(fp, "auto")`) fits in the free RAM, else bfloat16 alone."""
    need, words = memory_need(fp, "auto", max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                              packed_copy=packed_copy, kv_dtype=kv_dtype)
    if need <= ram_free:
        return ("float32", "bfloat16"), ""
    return ("bfloat16",), f"float32 not tried: timing it needs {fmt_bytes(need)} ({words}), {fmt_bytes(ram_free)} free"


def auto_weight_formats(
    fp: ModelFootprint, ram_free: int, dtypes: tuple[str, ...], *, max_model_len: int | None,
    kv_cache_bytes: int | None, packed_copy: bool = False, kv_dtype: str = "auto",
) -> tuple[tuple[str, ...], str]:
    """The dense dtypes `--weight-format auto` times beside a GGUF's quantized weights (of `dtypes`, the candidates),
    and why any is left out. Rule: the probe's peak, quantized weights + KV cache + every dense copy tried (dequantized
    in memory), must fit in the free RAM; while it does not, the biggest copy is dropped (float32 before bfloat16)."""
    tried, words = tuple(dtypes), ""
    while tried:
        need, why = memory_need(fp, "float32", max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                                packed_copy=packed_copy, dense=tried, kv_dtype=kv_dtype)
        if need <= ram_free:
            break
        words = words or f"timing it needs {fmt_bytes(need)} ({why}), {fmt_bytes(ram_free)} free"
        tried = tuple(sorted(tried, key=dtype_bytes)[:-1])
    left = [d for d in dtypes if d not in tried]
    return tried, f"dense {' and '.join(left)} not tried: {words}" if left else ""


@dataclass(frozen=True, slots=True)
class ServingSize:
    """One model of several: the KV cache it gets (sized explicitly, never a share of free memory) and what it needs
    in all, in bytes and in words."""

    kv_cache_bytes: int
    need_bytes: int
    need_words: str


def serving_size(
    fp: ModelFootprint, dtype: str, *, kv_dtype: str, max_model_len: int | None, kv_cache_bytes: int | None,
    packed_copy: bool,
) -> ServingSize:
    """The model's `kv_cache_bytes`, else one sequence of the full context; and its whole need with that cache."""
    kv = int(kv_cache_bytes or kv_cache_need(fp, kv_cache_stored(dtype, kv_dtype, fp.weight_bytes is not None),
                                                    max_model_len, None))
    need, words = memory_need(fp, dtype, max_model_len=max_model_len, kv_cache_bytes=kv, packed_copy=packed_copy,
                              kv_dtype=kv_dtype)  # fmt: skip
    return ServingSize(kv, need, words)
