"""Peregrine's own CPU kernels (`csrc/`: a shared header `kernels.h`, the vector layer `vec.h`, one file per kernel
family, `bindings.cpp`), for the decode steps torch's general kernels serve badly. Each is written once over
`vec.h`'s `Vec` (AVX-512, AVX2 + FMA, NEON or scalar, picked by the compiler flags) for float32 and bfloat16.

- `linear_small`, a bandwidth-bound linear for decode steps of 1 to 8 rows. At batch 1 a decode step reads every
  weight once, so its speed is memory bandwidth / weight bytes. Each weight row is streamed once, for up to 8
  inputs per pass, through AVX512-BF16 dot products (bf16 at the avx512_bf16 level) or FMA in float32. Larger
  batches are compute bound, where torch's GEMM is the better kernel, so `linear_for` only sends it the small ones.
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
  of 32 (256 for the K-quants; `qdot.h`, as llama.cpp does); `qlinear` exposes that matmul on its own. `engine.model.forward` runs
  decode-only steps through it: at batch 1 the ~450 small ops per step that remain around the weight reads, and the
  thread wake-ups between them, are what keep the Python-level path from the memory roofline.

The sources are compiled once per ISA level ("avx512_bf16" with the AMX flags, "avx512", "avx_vnni", "avx2", "neon";
`cpu_features.kernel_build` picks the best the CPU has under the configured cap, the one ISA map) with torch's
extension builder on first use (a C++ compiler is needed; about a minute on a quiet machine), through the one
loader `build.load_extension`, and cached under `<cache>/kernels/`, keyed by the sources' bytes, the flags and
torch's version (not their path: another clone loads the same build), so later starts load it in milliseconds.
The path taken is logged once. When no level applies, no compiler is found, or the build fails, `load()` logs why
once and the engine keeps torch's ops. Which kernels serve which dtype on which level is measured (`LINEAR_ROWS`,
`DECODER_DTYPES`, `ADD_NORM_DTYPES`; the figures are in docs). Everything here is chosen under the engine's
`KernelOptions` (enabled, cache dir, ISA cap), by the CPU backend (engine/backends/cpu.py), which also loads the
quantized-weight kernels into the same set.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from engine.backends import cpu_features, quant_kernels
from engine.backends.build import load_extension
from engine.backends.kernels import (
    AddRMSNorm,
    Argmax,
    DecodeAttention,
    DecoderFactory,
    KernelOptions,
    Kernels,
    Linear,
    add_rms_norm_torch,
    argmax_torch,
    linear_torch,
    onednn_linear,
)

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # a shared header, the vector layer and one file per kernel family
NAME = "peregrine_cpu_kernels"
LEVELS = ("avx512_bf16", "avx512", "avx_vnni", "avx2", "neon")  # the builds there are (build.LEVEL_FLAGS)
MAX_ROWS = 8  # bf16, AVX512-BF16: 2.3x F.linear at 1 row, 1.3x at 4, even at 8, slower beyond (oneDNN's AMX GEMM)
# The rows per call (first, last) that each dtype's linear sends to the kernel, per build level; torch's op for the
# rest. Measured (README "CPU kernels"): on the AVX2 EPYC, torch's float32 and bf16 linear at one row (MKL's
# gemv) beat the kernel (0.3-0.9x), which wins from 4 rows to 16 (1.5-3.9x). avx512 (its bf16 rows widened to
# float32, no `vdpbf16ps`) and avx_vnni (the avx2 build's linear; VNNI is int8 only) are not measured: they keep
# the rows of the build they are closest to.
LINEAR_ROWS: dict[tuple[str, torch.dtype], tuple[int, int]] = {
    ("avx512_bf16", torch.bfloat16): (1, MAX_ROWS), ("avx512_bf16", torch.float32): (1, MAX_ROWS),
    ("avx512", torch.bfloat16): (1, MAX_ROWS), ("avx512", torch.float32): (1, MAX_ROWS),
    ("avx_vnni", torch.bfloat16): (2, 16), ("avx_vnni", torch.float32): (2, 16),
    ("avx2", torch.bfloat16): (2, 16), ("avx2", torch.float32): (2, 16),
    ("neon", torch.bfloat16): (1, MAX_ROWS), ("neon", torch.float32): (1, MAX_ROWS),
}

_said: set[str | None] = set()  # paths and reasons logged already: each once


def build_level(cap: str = "auto") -> str | None:
    """The build the kernels use here under `cap`: one of LEVELS ("avx512_bf16": AMX picked at run time inside
    it); None where there is none."""
    return cpu_features.kernel_build(cap)


def unsupported_reason(cap: str = "auto") -> str | None:
    """Why the kernels cannot run on this machine under `cap`, or None when they can."""
    if build_level(cap) is None:
        detected = cpu_features.detected_level()
        if detected != "none":
            return f"hidden by --cpu-isa {cpu_features.ceiling(cap)} (this CPU: {detected})"
        return "this CPU has neither AVX2 + FMA + F16C nor NEON"
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        get_cxx_compiler()
    except RuntimeError as exc:  # no compiler found
        return f"no C++ compiler ({exc})"
    return None


def load(cache_dir: Path, level: str | None = None, cap: str = "auto") -> ModuleType | None:
    """The compiled extension for `level` (default: `build_level(cap)`), built into `cache_dir` on first use, or
    None when this machine cannot run it (logged once). The path taken is logged once per process."""
    level = level or build_level(cap)
    reason = unsupported_reason(cap) if level is None or level == build_level(cap) else None
    if level is not None and level not in LEVELS:  # build's "none": not a build of these kernels
        reason = f"no {level} build (the kernels are built for {', '.join(LEVELS)})"
    if level is None or reason is not None:
        return _off(reason)
    module, reason = load_extension(NAME, sources(), level, cache_dir)
    if module is None:
        return _off(reason)
    _once(f"CPU kernels: {module.isa()} path (built for {level}; this CPU: {cpu_features.detected_level()}, "
          f"cap {cpu_features.ceiling(cap)})")
    return module


def sources() -> list[Path]:
    """The kernels' source files (quant*.cpp are quant_kernels.py's module)."""
    return sorted(p for p in CSRC.glob("*.cpp") if not p.name.startswith("quant"))


def _once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info("%s", message)


def _off(reason: str | None) -> None:
    if reason not in _said:
        _said.add(reason)
        log.warning("Peregrine's CPU kernels off (%s); using torch's own", reason)


def _for(opts: KernelOptions, dtype: torch.dtype | None = None) -> ModuleType | None:
    """The kernels, when they are wanted (on; float32 or bfloat16 when `dtype` is given) and load."""
    if not opts.enabled or (dtype is not None and dtype not in (torch.bfloat16, torch.float32)):
        return None
    if opts.cache_dir is None:  # main.py always passes one (config's); an engine built by hand may not
        return _off("no cache dir to build them into: EngineConfig.cache_dir is unset")
    return load(opts.cache_dir, cap=opts.isa)


def linear_for(dtype: torch.dtype, opts: KernelOptions) -> Linear:
    """The linear the forward pass should call: the kernel for small CPU batches (`LINEAR_ROWS` for the dtype and
    build) when it loads, else torch's (`engine.backends.kernels.linear_torch`: float32 through oneDNN)."""
    module = _for(opts, dtype)
    first, last = LINEAR_ROWS.get((build_level(opts.isa) or "", dtype), (0, 0)) if module is not None else (0, 0)
    if module is None or last == 0:
        return linear_torch
    kernel = module.linear_small

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (x.dim() == 2 and first <= x.shape[0] <= last and x.shape[1] % 32 == 0 and x.stride(1) == 1
                and x.dtype == weight.dtype and weight.is_contiguous()):
            return kernel(x, weight, bias)
        return linear_torch(x, weight, bias)

    return linear


def decode_attention_for(opts: KernelOptions) -> DecodeAttention | None:
    """`paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, block_size, scale, softcap)` on CPU when the
    kernels load, else None (attention then gathers and runs SDPA)."""
    module = _for(opts)
    return None if module is None else module.paged_decode_attention


def argmax_for(opts: KernelOptions) -> Argmax:
    """Row-wise argmax of [rows, vocab] logits with torch.argmax's answers (first maximum; NaN counts as the
    largest): the kernel for contiguous float32 CPU tensors when it loads, else torch's."""
    module = _for(opts)
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
# avx512 and avx_vnni, not measured on their own, follow avx512_bf16 and avx2 (the same vector code).
DECODER_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "avx512_bf16": (torch.bfloat16, torch.float32), "avx512": (torch.bfloat16, torch.float32),
    "avx_vnni": (torch.bfloat16, torch.float32), "avx2": (torch.bfloat16, torch.float32),
    "neon": (torch.bfloat16, torch.float32),
}
ADD_NORM_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "avx512_bf16": (torch.bfloat16,), "avx512": (torch.bfloat16,), "avx_vnni": (torch.bfloat16, torch.float32),
    "avx2": (torch.bfloat16, torch.float32), "neon": (torch.bfloat16, torch.float32),
}


def _serves(table: dict[str, tuple[torch.dtype, ...]], dtype: torch.dtype, opts: KernelOptions) -> bool:
    return dtype in table.get(build_level(opts.isa) or "", ())


def llama_decoder_for(dtype: torch.dtype, opts: KernelOptions, amx: bool | None = None) -> DecoderFactory | None:
    """A builder of `LlamaDecoder_<dtype>(embed, layers, final_norm, head, head_bias, heads, kv_heads, head_dim,
    eps, block_size, scale)` (`LlamaDecoder_<dtype>_kv_float16` where the caches are float16) for float32 or
    bfloat16 on CPU when the kernels load and serve that dtype (`DECODER_DTYPES`), else None. Where
    `cpu_features.amx` (the one AMX decision) says so and the OS grants the tiles (`amx`: None), or as told (False:
    none), AMX takes bf16 dense matmuls (the decoder then keeps a packed copy of the weights) and, in any dtype, the
    tiled Q4_0 / Q4_1 / Q8_0 weights' steps of 9 rows and more (int8 tiles, the same bits as without:
    qdot_lanes.h)."""
    module = _for(opts, dtype)
    if module is None or not _serves(DECODER_DTYPES, dtype, opts):
        return None
    amx = bool(module.amx_available()) and cpu_features.amx(opts.isa) if amx is None else amx
    int8 = amx and bool(module.amx_int8_available())  # what the decoder asks too (decoder.cpp: amx_int8_)
    log.info("decode steps: one kernel call per step, %s matmuls on %s", str(dtype).removeprefix("torch."),
             "AMX" if amx and dtype == torch.bfloat16 else
             f"{module.isa()} (tiled quantized weights on AMX int8 tiles from 9 rows)" if int8 else module.isa())
    name = f"LlamaDecoder_{str(dtype).removeprefix('torch.')}"

    def build(embed: torch.Tensor, embed_type: int, layers: list[list[torch.Tensor]], *rest: object) -> object:
        kv = layers[0][2].dtype if layers else dtype  # each layer: input_norm, post_norm, k_cache, v_cache
        cls = getattr(module, name if kv == dtype else f"{name}_kv_{str(kv).removeprefix('torch.')}", None)
        if cls is None:
            raise RuntimeError(f"no one-call decode step for a {kv} KV cache with a {dtype} model")
        return cls(embed, embed_type, layers, *rest, amx)

    return build


def add_rms_norm_for(dtype: torch.dtype, opts: KernelOptions) -> AddRMSNorm:
    """The fused kernel on CPU when it loads and serves `dtype` (`ADD_NORM_DTYPES`); else `add_rms_norm_torch`."""
    module = _for(opts, dtype)
    if module is None or not _serves(ADD_NORM_DTYPES, dtype, opts):
        return add_rms_norm_torch
    kernel = module.add_rms_norm_

    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if h.dim() == 2 and h.is_contiguous() and (delta is None or delta.is_contiguous()):
            return kernel(h, delta, weight, eps)
        return add_rms_norm_torch(h, delta, weight, eps)

    return add_rms_norm


def kernels_for(dtype: torch.dtype, opts: KernelOptions) -> Kernels:
    """The kernel set for a model in `dtype` on the CPU: Peregrine's CPU kernels where they load and serve the
    dtype, torch's ops for the rest; the quantized-weight kernels when the kernels are on (`opts.enabled`)."""
    onednn_linear()  # the one oneDNN probe, here rather than at import
    module = _for(opts)
    quant = quant_kernels.load(opts.cache_dir, cap=opts.isa) if opts.enabled and opts.cache_dir else None
    decoder = llama_decoder_for(dtype, opts)
    return Kernels(
        linear=linear_for(dtype, opts),
        decode_attention=decode_attention_for(opts),
        add_rms_norm=add_rms_norm_for(dtype, opts),
        argmax=argmax_for(opts),
        decoder=decoder,
        quant=quant,
        tile_rows=int(module.tile_rows()) if decoder is not None and module is not None else 0,
        path="torch" if module is None else str(module.isa()),
    )
