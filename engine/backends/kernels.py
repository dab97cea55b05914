"""The kernel set a backend hands the engine: one `Kernels` object, chosen once, passed once.

The forward pass (`engine.model.forward`, `engine.model.attention`), the quantized weights (`engine.model.quant`) and
the sampler call these things and nothing device-specific. The defaults are torch's own ops, which run everywhere;
`engine.backends.cpu_kernels.kernels_for` swaps in Peregrine's CPU kernels where they load (the CPU backend's
`kernels()`, engine/backends/cpu.py, under the engine's `KernelOptions`). Each kernel takes exactly what
the torch default takes and gives its answers within the bounds its tests state; a kernel that cannot take a
given input (a shape, a dtype) passes it on to the torch op itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.backends import cpu_features

# linear(x [rows, in], weight [out, in], bias [out] | None) -> [rows, out]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# paged_decode_attention(q [B, H, D], k_cache, v_cache [slots, KVH, D] (q's dtype or float16), block_tables
# [B, blocks], lengths [B], block_size, scale, softcap (0: none; Gemma 2: its scores capped)) -> [B, H, D]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, float],
                           torch.Tensor]
# add_rms_norm(h, delta | None, weight, eps): h += delta in place, returns RMSNorm(h) * weight
AddRMSNorm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor]
# argmax(logits [rows, vocab]) -> [rows], torch.argmax's answers
Argmax = Callable[[torch.Tensor], torch.Tensor]
# decoder(embed, layers, final_norm, head, head_bias, heads, kv_heads, head_dim, eps, block_size, scale) -> an
# object whose step(ids, rope_rows, cos, sin, slots, block_tables, lengths) gives float32 logits
DecoderFactory = Callable[..., object]


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """What the engine's config says about kernels, handed to the backend once: `enabled` (--cpu-kernels),
    `cache_dir` (where extensions build: EngineConfig.cache_dir), `isa` (the cap, EngineConfig.cpu_isa)."""

    enabled: bool
    cache_dir: Path | None
    isa: str = "auto"


def _onednn_float32() -> Callable[..., torch.Tensor] | None:
    """torch's oneDNN linear (`torch.ops.mkldnn._linear_pointwise`, the op torch.compile's CPU backend fuses
    linears into), where this torch has it and it runs in float32."""
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        op = torch.ops.mkldnn._linear_pointwise
        out = op(torch.ones(2, 8), torch.ones(3, 8), None, "none", [], "")
        return op if tuple(out.shape) == (2, 3) and bool((out == 8).all()) else None
    except (AttributeError, RuntimeError):
        return None


def float32_linear_for(vendor: str) -> Callable[..., torch.Tensor] | None:
    """oneDNN's float32 linear on AMD CPUs, where MKL (torch's float32 matmul) runs its AVX2 code; None elsewhere:
    on Intel CPUs MKL runs its best code, and other CPUs are unmeasured."""
    return _onednn_float32() if vendor == "AuthenticAMD" else None


@cache
def onednn_linear() -> Callable[..., torch.Tensor] | None:
    """This CPU's float32 oneDNN linear, probed once on first use (the CPU backend asks when it builds its kernel
    set), never at import."""
    return float32_linear_for(cpu_features.cpu_vendor())


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with float32 on AMD CPUs through oneDNN rather than MKL: torch's float32 matmul calls MKL, which
    runs its AVX2 code there, where oneDNN uses the CPU's best ISA. Prefill-size GEMMs on an AMD EPYC Zen 5
    (AVX-512, two cores): 460-500 against 200-230 GFLOPS (130 x 576 x 1536 up to 1024^3); with oneDNN held to AVX2
    (as on a Zen 3) still 1.1x. The same float32 products; the summation order is oneDNN's."""
    onednn = onednn_linear()
    if (onednn is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and x.dim() >= 2 and x.numel() > 0 and weight.dim() == 2
            and (bias is None or bias.dtype == torch.float32)):
        return onednn(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def add_rms_norm_torch(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, when given); returns transformers' LlamaRMSNorm of h: float32 statistics, scaled in
    h's dtype."""
    if delta is not None:
        h.add_(delta)
    x32 = h.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(h.dtype)


def argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass(frozen=True, slots=True)
class Kernels:
    """What the engine computes with. `decode_attention` None: gather the context and run a masked SDPA;
    `decoder` None: decode steps run op by op; `quant` None: quantized weights dequantize for torch's matmul (the
    portable reference), else the quantized-weight kernels' module (engine/backends/quant_kernels.py)."""

    linear: Linear = linear_torch
    decode_attention: DecodeAttention | None = None
    add_rms_norm: AddRMSNorm = add_rms_norm_torch
    argmax: Argmax = argmax_torch
    decoder: DecoderFactory | None = None
    quant: ModuleType | None = None
    tile_rows: int = 0  # the decoder multiplies packed Q4_0 / Q4_1 / Q8_0 tiled in tiles of these rows (0: as rows)
    path: str = "torch"  # which kernels: "torch", or the CPU build (its isa(): "avx2", "avx512_bf16", "neon", ...)


TORCH = Kernels()
