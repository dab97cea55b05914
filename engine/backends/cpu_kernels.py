"""Peregrine's own CPU kernels (`csrc/`: a shared header `kernels.h`, the vector layer `vec.h`, one file per kernel
family, `bindings.cpp`), for the decode steps torch's general kernels serve badly. Each is written once over
`vec.h`'s `Vec` (AVX-512, AVX2 + FMA, NEON or scalar, picked by the compiler flags) for float32 and bfloat16.

- `linear_small`, a bandwidth-bound linear for decode steps of 1 to 8 rows. At batch 1 a decode step reads every
  weight once, so its speed is memory bandwidth / weight bytes. Each weight row is streamed once, for up to 8
  inputs per pass, through AVX512-BF16 dot products (bf16 on AVX-512) or FMA in float32. Larger batches are
  compute bound, where torch's GEMM is the better kernel, so `linear_for` only sends it the small ones.
- `paged_decode_attention`, decode attention read straight from the paged KV cache through the block tables
  (float32 or bfloat16, softmax in float32). The torch path gathers every sequence's context into a padded
  copy and runs a masked SDPA; at decode sizes that is a handful of ops per layer whose fixed cost dominates.
- `add_rms_norm_`, the residual add and Llama's RMSNorm in one pass (eight torch ops), with transformers'
  rounding.
- `argmax_rows`, greedy sampling's argmax over float32 logits: vectorized, where torch's reduction is scalar.
- `LlamaDecoder_float32` / `LlamaDecoder_bfloat16`, a whole decode step of a Llama-family model (token ids in:
  the embedding lookup, every layer, the final norm and the LM head; float32 logits out) in one call and one
  parallel region, its bf16 matmuls on AMX tiles where the CPU has them, over a copy of the weights packed in the
  order a step reads them (else `linear_small`'s rows on the model's own weights), its attention in fixed
  64-position chunks. GGUF weights kept quantized are multiplied in int8 against activations quantized in blocks
  of 32 (`qdot.h`, as llama.cpp does); `qlinear` exposes that matmul on its own. `engine.model.forward` runs
  decode-only steps through it: at batch 1 the ~450 small ops per step that remain around the weight reads, and the
  thread wake-ups between them, are what keep the Python-level path from the memory roofline.

The sources are compiled once per ISA level (`engine.backends.build.build_extension`: "avx512" with the AMX
flags, "avx2", "neon") with torch's extension builder on first use (a C++ compiler is needed; about a minute on
a quiet machine) and cached under `<cache>/kernels/`, keyed by the sources' bytes, the flags and torch's version
(not their path: another clone loads the same build), so later starts load it in milliseconds. `build_level()`
picks the best level the CPU has under the PEREGRINE_CPU_ISA ceiling, and the path taken is logged once. When no
level applies, no compiler is found, or the build fails, `load()` logs why once and the engine keeps torch's ops.
Which kernels serve which dtype on which level is measured (`LINEAR_ROWS`, `DECODER_DTYPES`, `ADD_NORM_DTYPES`;
the figures are in README "CPU kernels").
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from engine.backends import cpu_features
from engine.backends.build import build_extension, build_key, level_flags
from engine.backends.kernels import (
    AddRMSNorm,
    Argmax,
    DecodeAttention,
    DecoderFactory,
    Kernels,
    Linear,
    add_rms_norm_torch,
    argmax_torch,
    linear_torch,
)

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # a shared header, the vector layer and one file per kernel family
NAME = "peregrine_cpu_kernels"
LEVELS = ("avx512", "avx2", "neon")  # the builds there are (extension_build.LEVEL_FLAGS); build_level() picks
MAX_ROWS = 8  # bf16, AVX512-BF16: 2.3x F.linear at 1 row, 1.3x at 4, even at 8, slower beyond (oneDNN's AMX GEMM)
# The rows per call (first, last) that each dtype's linear sends to the kernel, per build level; torch's op for the
# rest. Measured (README "CPU kernels"): on the AVX2 EPYC, torch's float32 and bf16 linear at one row (MKL's
# gemv) beat the kernel (0.3-0.9x), which wins from 4 rows to 16 (1.5-3.9x).
LINEAR_ROWS: dict[tuple[str, torch.dtype], tuple[int, int]] = {
    ("avx512", torch.bfloat16): (1, MAX_ROWS), ("avx512", torch.float32): (1, MAX_ROWS),
    ("avx2", torch.bfloat16): (2, 16), ("avx2", torch.float32): (2, 16),
    ("neon", torch.bfloat16): (1, MAX_ROWS), ("neon", torch.float32): (1, MAX_ROWS),
}

_loaded: dict[tuple[str, str], ModuleType | None] = {}  # (level, build key) -> module, None: failed
_said: set[str | None] = set()  # paths and reasons logged already: each once


def default_cache_dir() -> Path:
    """Where kernels build when the caller names no cache dir (the engine always passes EngineConfig.cache_dir):
    config's, the one default (config imports nothing of Peregrine's, so this adds no cycle)."""
    from config import tool_cache_dir

    return tool_cache_dir()


def build_level() -> str | None:
    """The build the kernels use here: "avx512" (AMX picked at run time inside it), "avx2" or "neon", the best the
    CPU has under the PEREGRINE_CPU_ISA ceiling; None where there is none."""
    level = cpu_features.isa_level()
    if level in ("avx512", "amx"):
        return "avx512"
    if level == "avx2":
        return "avx2"
    if platform.machine() in ("aarch64", "arm64") and cpu_features.ceiling() != "none":
        return "neon"  # every aarch64 CPU has NEON
    return None


def unsupported_reason() -> str | None:
    """Why the kernels cannot run on this machine, or None when they can."""
    if build_level() is None:
        detected = cpu_features.detected_level()
        if detected != "none":
            return f"hidden by {cpu_features.ENV}={cpu_features.ceiling()} (this CPU: {detected})"
        return "this CPU has neither AVX2 + FMA + F16C nor NEON"
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        get_cxx_compiler()
    except RuntimeError as exc:  # no compiler found
        return f"no C++ compiler ({exc})"
    return None


def load(cache_dir: Path | None = None, level: str | None = None) -> ModuleType | None:
    """The compiled extension for `level` (default: `build_level()`), built on first use, or None when this machine
    cannot run it (logged once). The path taken is logged once per process."""
    level = level or build_level()  # the ceiling can change between calls (tests); each level is its own build
    reason = unsupported_reason() if level is None or level == build_level() else None
    if level is not None and level not in LEVELS:  # extension_build's "none": not a build of these kernels
        reason = f"no {level} build (the kernels are built for {', '.join(LEVELS)})"
    if level is None or reason is not None:
        return _off(reason)
    cache = cache_dir or default_cache_dir()
    sources = sorted(p for p in CSRC.glob("*.cpp") if not p.name.startswith("quant"))  # quant*: quant_kernels.py
    # One module per level and source set in a process, wherever it was built: pybind11 refuses to register the
    # same classes twice, so another cache folder reuses the module already loaded.
    key = (level, build_key(sources, level_flags(level)))
    if key in _loaded:
        return _loaded[key] or _off(f"the {level} build failed earlier")
    module = None
    try:
        module = build_extension(NAME, sources, level, cache)
        _once(f"CPU kernels: {module.isa()} path (built for {level}; this CPU: {cpu_features.detected_level()}, "
              f"ceiling {cpu_features.ceiling()})")
    except Exception as exc:  # a failed build must never stop the server: torch's ops still work
        text = str(exc).strip()
        reason = f"build failed: {text.splitlines()[-1] if text else type(exc).__name__}"
    _loaded[key] = module
    return module if module is not None else _off(reason)


def _once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info("%s", message)


def _off(reason: str | None) -> None:
    if reason not in _said:
        _said.add(reason)
        log.warning("Peregrine's CPU kernels off (%s); using torch's own", reason)


def _for(device: torch.device, enabled: bool, cache_dir: Path | None,
         dtype: torch.dtype | None = None) -> ModuleType | None:
    """The kernels, when they are wanted here (on, on CPU, float32 or bfloat16 when `dtype` is given) and load."""
    if not enabled or device.type != "cpu" or (dtype is not None and dtype not in (torch.bfloat16, torch.float32)):
        return None
    return load(cache_dir)


def linear_for(device: torch.device, dtype: torch.dtype, enabled: bool = True,
               cache_dir: Path | None = None) -> Linear:
    """The linear the forward pass should call: the kernel for small CPU batches (`LINEAR_ROWS` for the dtype and
    build) when it loads, else torch's (`engine.backends.kernels.linear_torch`: float32 through oneDNN)."""
    module = _for(device, enabled, cache_dir, dtype)
    first, last = LINEAR_ROWS.get((build_level() or "", dtype), (0, 0)) if module is not None else (0, 0)
    if module is None or last == 0:
        return linear_torch
    kernel = module.linear_small

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (x.dim() == 2 and first <= x.shape[0] <= last and x.shape[1] % 32 == 0 and x.stride(1) == 1
                and x.dtype == weight.dtype and weight.is_contiguous()):
            return kernel(x, weight, bias)
        return linear_torch(x, weight, bias)

    return linear


def decode_attention_for(device: torch.device, enabled: bool = True,
                         cache_dir: Path | None = None) -> DecodeAttention | None:
    """`paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, block_size, scale)` on CPU when the
    kernels load, else None (attention then gathers and runs SDPA)."""
    module = _for(device, enabled, cache_dir)
    return None if module is None else module.paged_decode_attention


def argmax_for(device: torch.device, enabled: bool = True, cache_dir: Path | None = None) -> Argmax:
    """Row-wise argmax of [rows, vocab] logits with torch.argmax's answers (first maximum; NaN counts as the
    largest): the kernel for contiguous float32 CPU tensors when it loads, else torch's."""
    module = _for(device, enabled, cache_dir)
    if module is None:
        return argmax_torch
    kernel = module.argmax_rows

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape[1]:
            return kernel(logits)
        return argmax_torch(logits)

    return argmax


# Which dtypes each build's whole-step decoder and fused add + RMSNorm serve (measured against the op-by-op pass
# with torch's ops, README "CPU kernels"); a dtype left out keeps torch's ops there.
DECODER_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "avx512": (torch.bfloat16, torch.float32), "avx2": (torch.bfloat16, torch.float32),
    "neon": (torch.bfloat16, torch.float32),
}
ADD_NORM_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "avx512": (torch.bfloat16,), "avx2": (torch.bfloat16, torch.float32), "neon": (torch.bfloat16, torch.float32),
}


def _serves(table: dict[str, tuple[torch.dtype, ...]], dtype: torch.dtype) -> bool:
    return dtype in table.get(build_level() or "", ())


def llama_decoder_for(device: torch.device, dtype: torch.dtype, enabled: bool = True,
                      cache_dir: Path | None = None, amx: bool | None = None) -> DecoderFactory | None:
    """A builder of `LlamaDecoder_<dtype>(embed, layers, final_norm, head, head_bias, heads, kv_heads, head_dim,
    eps, block_size, scale)` (`LlamaDecoder_<dtype>_kv_float16` where the caches are float16) for float32 or
    bfloat16 on CPU when the kernels load and serve that dtype (`DECODER_DTYPES`), else None. bf16 matmuls use AMX
    when the CPU has it (`amx`: None; the decoder then keeps a packed copy of the weights) or as told (False: the
    vector rows of `linear_small` on the model's own weights)."""
    module = _for(device, enabled, cache_dir, dtype)
    if module is None or not _serves(DECODER_DTYPES, dtype):
        return None
    if dtype != torch.bfloat16:
        amx = False
    amx = bool(module.amx_available()) and cpu_features.has("amx") if amx is None else amx
    log.info("decode steps: one kernel call per step, %s matmuls on %s", str(dtype).removeprefix("torch."),
             "AMX" if amx else module.isa())
    name = f"LlamaDecoder_{str(dtype).removeprefix('torch.')}"

    def build(embed: torch.Tensor, embed_type: int, layers: list[list[torch.Tensor]], *rest: object) -> object:
        kv = layers[0][2].dtype if layers else dtype  # each layer: input_norm, post_norm, k_cache, v_cache
        cls = getattr(module, name if kv == dtype else f"{name}_kv_{str(kv).removeprefix('torch.')}", None)
        if cls is None:
            raise RuntimeError(f"no one-call decode step for a {kv} KV cache with a {dtype} model")
        return cls(embed, embed_type, layers, *rest, amx)

    return build


def add_rms_norm_for(device: torch.device, dtype: torch.dtype, enabled: bool = True,
                     cache_dir: Path | None = None) -> AddRMSNorm:
    """The fused kernel on CPU when it loads and serves `dtype` (`ADD_NORM_DTYPES`); else `add_rms_norm_torch`."""
    module = _for(device, enabled, cache_dir, dtype)
    if module is None or not _serves(ADD_NORM_DTYPES, dtype):
        return add_rms_norm_torch
    kernel = module.add_rms_norm_

    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if h.dim() == 2 and h.is_contiguous() and (delta is None or delta.is_contiguous()):
            return kernel(h, delta, weight, eps)
        return add_rms_norm_torch(h, delta, weight, eps)

    return add_rms_norm


def kernels_for(device: torch.device, dtype: torch.dtype, enabled: bool = True,
                cache_dir: Path | None = None) -> Kernels:
    """The kernel set for a model in `dtype` on `device`: Peregrine's CPU kernels where they load and serve the
    dtype, torch's ops for the rest."""
    module = _for(device, enabled, cache_dir)
    return Kernels(
        linear=linear_for(device, dtype, enabled, cache_dir),
        decode_attention=decode_attention_for(device, enabled, cache_dir),
        add_rms_norm=add_rms_norm_for(device, dtype, enabled, cache_dir),
        argmax=argmax_for(device, enabled, cache_dir),
        decoder=llama_decoder_for(device, dtype, enabled, cache_dir),
        path="torch" if module is None else str(module.isa()),
    )
