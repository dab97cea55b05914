"""Peregrine's own CPU kernels (`csrc/`: a shared header `kernels.h`, one file per kernel family, `bindings.cpp`),
for the decode steps torch's general kernels serve badly.

- `linear_bf16`, a bandwidth-bound bfloat16 linear for decode steps of 1 to 8 rows. At batch 1 a decode step
  reads every weight once, so its speed is memory bandwidth / weight bytes. torch's bf16 `F.linear` (oneDNN)
  reaches about a third of this machine's bandwidth at one row; the kernel streams each weight row once
  through AVX512-BF16 dot products and about doubles it. Larger batches are compute bound, where oneDNN's AMX
  GEMM is the better kernel, so `linear_for` only sends it the small ones.
- `paged_decode_attention`, decode attention read straight from the paged KV cache through the block tables
  (float32 or bfloat16, softmax in float32). The torch path gathers every sequence's context into a padded
  copy and runs a masked SDPA; at decode sizes that is a handful of ops per layer whose fixed cost dominates.
- `add_rms_norm_`, the residual add and Llama's RMSNorm in one pass (eight torch ops), with transformers'
  rounding; used for bfloat16, where it is most of the per-layer op count that is not a matmul.
- `argmax_rows`, greedy sampling's argmax over float32 logits: vectorized, where torch's reduction is scalar
  (0.25 ms a row of a 49k vocabulary, 1.4 ms at 16 rows, on this machine).
- `LlamaDecoder`, a whole bfloat16 decode step of a Llama-family model (token ids in: the embedding lookup,
  every layer, the final norm and the LM head; float32 logits out) in one call and one parallel region, its
  matmuls on AMX tiles where the CPU has them, over a copy of the weights packed in the order a step reads them
  (else the AVX512-BF16 rows of `linear_bf16` on the model's own weights), its attention in fixed 64-position
  chunks. `engine.llama_fast` runs decode-only steps through it: at batch 1 the
  ~450 small ops per step that remain around the weight reads, and the thread wake-ups between them, are what
  keep the Python-level path from the memory roofline; at 16 rows AMX does the matmuls at the cost of reading
  the weights, where oneDNN's GEMM repacks them on every call.

The sources (`csrc/*.cpp`) are compiled with torch's own extension builder on first use (a C++ compiler is
needed; about a minute on a quiet machine) and cached under `<cache>/kernels/`, keyed by the source, its path and torch version, so later
starts load it in milliseconds. When the CPU lacks AVX512-BF16, no compiler is found, or the build fails,
`load()` logs why once and the engine keeps torch's ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from engine import cpu_features
from engine.extension_build import exclusive_build

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # a shared header and one file per kernel family
NAME = "peregrine_cpu_kernels"
MAX_ROWS = 8  # measured: 2.3x F.linear at 1 row, 1.3x at 4, even at 8, slower beyond (oneDNN's AMX GEMM wins)
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp"]

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

_loaded: dict[str, ModuleType | None] = {}
_said_off: set[str | None] = set()  # reasons logged already: each once


def default_cache_dir() -> Path:
    return Path(os.environ.get("PEREGRINE_CACHE_DIR", Path.home() / ".cache" / "peregrine"))


def unsupported_reason() -> str | None:
    """Why the kernel cannot run on this machine, or None when it can."""
    if not cpu_features.has("avx512"):
        if cpu_features.detected_level() in ("avx512", "amx"):
            return f"AVX-512 hidden by {cpu_features.ENV}={cpu_features.ceiling()}"
        return "this CPU has no AVX512-BF16"
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        get_cxx_compiler()
    except RuntimeError as exc:  # no compiler found
        return f"no C++ compiler ({exc})"
    return None



def load(cache_dir: Path | None = None) -> ModuleType | None:
    """The compiled extension (built on first use), or None when this machine cannot run it (logged once)."""
    sources = sorted(p for p in CSRC.glob("*.cpp") if not p.name.startswith("quant"))  # quant*: quant_kernels.py
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(CFLAGS).encode())
    for path in sorted([*sources, *(h for h in CSRC.glob("*.h") if not h.name.startswith("quant"))]):
        # keyed by the checkout too: torch's builder rebuilds when the same build folder sees another source path
        digest.update(str(path.resolve()).encode() + path.read_bytes())
    key = digest.hexdigest()[:16]
    if not cpu_features.has("avx512"):  # the ceiling can change between calls (tests); the build cannot
        return _off(unsupported_reason())
    if key in _loaded:
        return _loaded[key]
    reason = unsupported_reason()
    module = None
    if reason is None:
        build_dir = (cache_dir or default_cache_dir()) / "kernels" / key
        build_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        if not (build_dir / f"{NAME}.so").exists():
            log.info("compiling Peregrine's CPU kernels (%s) into %s, once", CSRC, build_dir)
        try:
            from torch.utils.cpp_extension import load as build

            with exclusive_build(build_dir):
                module = build(name=NAME, sources=[str(p) for p in sources], extra_cflags=CFLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
            log.info("CPU kernels ready in %.1f s", time.perf_counter() - started)
        except Exception as exc:  # a failed build must never stop the server: F.linear still works
            reason = f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
    _loaded[key] = module
    return module if module is not None else _off(reason)


def _off(reason: str | None) -> None:
    if reason not in _said_off:
        _said_off.add(reason)
        log.warning("Peregrine's CPU kernels off (%s); using torch's own", reason)


def _for(device: torch.device, enabled: bool, cache_dir: Path | None,
         dtype: torch.dtype | None = None) -> ModuleType | None:
    """The kernels, when they are wanted here (on, on CPU, and bfloat16 when `dtype` is given) and load."""
    if not enabled or device.type != "cpu" or (dtype is not None and dtype != torch.bfloat16):
        return None
    return load(cache_dir)


def linear_for(device: torch.device, dtype: torch.dtype, enabled: bool = True,
               cache_dir: Path | None = None) -> Linear:
    """The linear the forward pass should call: the kernel for small bf16 CPU batches when it loads, else F.linear."""
    module = _for(device, enabled, cache_dir, dtype)
    if module is None:
        return F.linear
    kernel = module.linear_bf16

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] % 32 == 0 and x.stride(1) == 1
                and weight.is_contiguous()):
            return kernel(x, weight, bias)
        return F.linear(x, weight, bias)

    return linear


DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                           torch.Tensor]


def decode_attention_for(device: torch.device, enabled: bool = True,
                         cache_dir: Path | None = None) -> DecodeAttention | None:
    """`paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, block_size, scale)` on CPU when the
    kernels load, else None (attention then gathers and runs SDPA)."""
    module = _for(device, enabled, cache_dir)
    return None if module is None else module.paged_decode_attention


AddRMSNorm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor]


def add_rms_norm_torch(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, when given); returns transformers' LlamaRMSNorm of h: float32 statistics, scaled in
    h's dtype."""
    if delta is not None:
        h.add_(delta)
    x32 = h.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(h.dtype)


Argmax = Callable[[torch.Tensor], torch.Tensor]


def argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


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


DecoderFactory = Callable[..., object]


def llama_decoder_for(device: torch.device, dtype: torch.dtype, enabled: bool = True,
                      cache_dir: Path | None = None, amx: bool | None = None) -> DecoderFactory | None:
    """A builder of `LlamaDecoder(embed, layers, final_norm, head, head_bias, heads, kv_heads, head_dim, eps,
    block_size, scale)` for bfloat16 on CPU when the kernels load, else None. Its matmuls use AMX when the CPU has it
    (`amx`: None; the decoder then keeps a packed copy of the weights) or as told (False: the AVX512-BF16 rows on
    the model's own weights)."""
    module = _for(device, enabled, cache_dir, dtype)
    if module is None:
        return None
    amx = bool(module.amx_available()) and cpu_features.has("amx") if amx is None else amx
    log.info("decode steps: one kernel call per step, matmuls on %s", "AMX" if amx else "AVX512-BF16")

    def build(*args: object) -> object:
        return module.LlamaDecoder(*args, amx)

    return build


def add_rms_norm_for(device: torch.device, dtype: torch.dtype, enabled: bool = True,
                     cache_dir: Path | None = None) -> AddRMSNorm:
    """The fused kernel for bfloat16 on CPU when it loads; else (and for float32, kept as the exact reference
    path) `add_rms_norm_torch`."""
    module = _for(device, enabled, cache_dir, dtype)
    if module is None:
        return add_rms_norm_torch
    kernel = module.add_rms_norm_

    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if h.dim() == 2 and h.is_contiguous() and (delta is None or delta.is_contiguous()):
            return kernel(h, delta, weight, eps)
        return add_rms_norm_torch(h, delta, weight, eps)

    return add_rms_norm
