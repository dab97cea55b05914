"""The KV cache: one K and one V tensor per layer, allocated once at start, split into paged blocks.

Layout per layer: [(num_blocks + 1) * block_size, kv_heads, head_dim] where slot = block * block_size + offset.
Elements in the model dtype (float16 where the weights are kept quantized), or as `--kv-cache-dtype` says
(`kv_cache_dtype`; float16 halves a float32 model's cache;
int8 keeps each (slot, KV head) row of head_dim values as int8 with one float32 scale beside it, in `k_scale` and
`v_scale` [slots, kv_heads] per layer: `quantize_kv`, what the CPU's one-call decoder stores too).
The extra last block is kept at zero and is where padded block tables point. The batched decode gathers whole
blocks, so the masked-out tail of a sequence's last block is read too: a mask gives it weight 0, but 0 * NaN
is NaN, so no block may hold garbage.

On the CPU each tensor is its own anonymous private mapping, page aligned: its pages read as zero until written and
the OS commits a page only when a block's K/V is first written there, so a cache of any size costs the memory its
used blocks fill, nothing at start (no zeroing pass either). Elsewhere (`torch.empty`, a GPU) a block is zeroed the
first time it is used (`ensure_zeroed`, in steps of 64 blocks).

Sliding-window layers (`KVCacheSpec.windows`, Gemma 3's 5 of 6) read only their last W positions, so the blocks of a
long sequence that lie wholly behind every window it will still attend hold K/V nothing reads again in those layers.
`release(blocks)` gives their pages back to the OS (madvise MADV_DONTNEED) in every windowed layer's K and V (the
global layers keep theirs); a given-back page reads as zero again, so the no-garbage rule holds, and a block handed
out again is simply written again. Which blocks, and when, is the block manager's decision
(`engine.core.block_manager`, its `window`: `release_window` here, 0 where nothing can be given back).
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.backends.huge_pages import whole_pages
from engine.model.families import layer_windows
from engine.types import kv_bytes_per_token, kv_dtype_for

log = logging.getLogger(__name__)

ZERO_STEP_BLOCKS = 64


def kv_cache_dtype(name: str, model_dtype: torch.dtype, quantized: bool = False) -> torch.dtype:
    """The KV cache's element type for `--kv-cache-dtype name` (engine.types.kv_dtype_for's rule): auto is the model
    dtype, but float16 for a float32 model whose weights are kept `quantized` (GGUF blocks on the CPU): half the
    memory a token takes and the bytes a decode step's attention reads."""
    return getattr(torch, kv_dtype_for(name, str(model_dtype).removeprefix("torch."), quantized))


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values [..., head_dim], float32 scales [...]): per row s = max|x| / 127 and q =
    round(x / s) (to nearest even), so x ~ q * s. The same float operations as the decoder's `quantize_kv_row`
    (engine/backends/csrc/attention.h), so both store the same bits."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 rows an int8 cache's values and scales stand for (quantize_kv's inverse, to its rounding)."""
    return q.float() * scale[..., None]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    windows: tuple[int, ...] = ()  # per layer its attention window (0: the whole context); () : none windowed

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  str(self.dtype).removeprefix("torch."))

    @classmethod
    def from_hf_config(cls, config: object, dtype: torch.dtype) -> KVCacheSpec:
        text = getattr(config, "get_text_config", lambda: config)()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, dtype, layer_windows(text))


def plan_num_blocks(
    spec: KVCacheSpec,
    block_size: int,
    free_bytes: int,
    fraction: float,
    explicit_bytes: int | None,
    max_useful_tokens: int,
) -> int:
    """Blocks that fit in `explicit_bytes`, else in `fraction` of `free_bytes`; never more than useful."""
    budget = explicit_bytes if explicit_bytes is not None else int(free_bytes * fraction)
    block_bytes = spec.bytes_per_token * block_size
    num_blocks = min(budget // block_bytes, -(-max_useful_tokens // block_size))
    if num_blocks <= 0:
        raise MemoryError(
            f"KV cache budget {budget} bytes is below one block ({block_bytes} bytes); "
            "raise kv_cache_memory_fraction or kv_cache_bytes"
        )
    return int(num_blocks)


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device,
                 release: bool = True, anonymous: bool | None = None) -> None:
        """`release`: give back the pages of windowed layers' dead blocks (`release`; off: `--no-kv-window-release`).
        `anonymous`: the tensors on anonymous mappings (None: on the CPU, where the OS has madvise)."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        shape = (self.num_slots + block_size, spec.num_kv_heads, spec.head_dim)
        if anonymous is None:
            anonymous = device.type == "cpu" and hasattr(mmap, "MADV_DONTNEED")
        self._maps: list[mmap.mmap] = []  # k[0], v[0], k[1], v[1], ... (then an int8 cache's scales) where anonymous
        self._zeroed_blocks = num_blocks if anonymous else 0  # anonymous pages read as zero until written
        pairs = [(self._alloc(shape, spec.dtype, device, anonymous), self._alloc(shape, spec.dtype, device, anonymous))
                 for _ in range(spec.num_layers)]
        self.k = [k for k, _ in pairs]
        self.v = [v for _, v in pairs]
        # an int8 cache's row scales, per layer [slots, kv_heads] float32 (empty lists otherwise), mapped after every
        # K and V (`release` advises those by layer); never given back (a block's scales are a sixteenth of its K or V
        # at head_dim 64): a given-back block's values read as zero, which is zero whatever scale stays beside them
        scales = [self._alloc(shape[:2], torch.float32, device, anonymous)
                  for _ in range(2 * spec.num_layers) if self.quantized]
        self.k_scale, self.v_scale = scales[0::2], scales[1::2]
        self._windowed = [i for i, w in enumerate(spec.windows) if w > 0] if release and anonymous else []
        self.released_bytes_total = 0  # bytes of windowed layers' pages given back (what `release` advised)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d layers)%s",
            num_blocks, block_size, self.num_slots, self.nbytes / 2**20, spec.dtype, spec.num_layers,
            f"; {len(self._windowed)} windowed layers give back the pages of blocks behind their window of "
            f"{self.release_window}" if self.release_window else "",
        )

    @property
    def quantized(self) -> bool:
        """Whether the cache keeps int8 values with a scale per row (`--kv-cache-dtype int8`)."""
        return self.spec.dtype == torch.int8

    @property
    def null_block(self) -> int:
        """A block that is always zero: what padded block tables point at."""
        return self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.spec.bytes_per_token

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer's K (or V)."""
        return self.block_size * self.spec.num_kv_heads * self.spec.head_dim * self.k[0].element_size()

    @property
    def release_window(self) -> int:
        """The window the block manager retires blocks behind (the widest windowed layer's: a block behind it is
        behind every window), 0 where nothing is given back: no windowed layer, not anonymous memory, release off,
        or a block smaller than a page (only whole pages inside one block are given back)."""
        if not self._windowed or self.block_bytes < mmap.PAGESIZE:
            return 0
        return max(self.spec.windows)

    def ensure_zeroed(self, num_blocks: int) -> None:
        """Zero every block below `num_blocks` that has not been zeroed yet (in steps of 64 blocks; nothing to do on
        anonymous memory)."""
        if num_blocks <= self._zeroed_blocks:
            return
        upto = min(self.num_blocks, max(num_blocks, self._zeroed_blocks + ZERO_STEP_BLOCKS))
        lo, hi = self._zeroed_blocks * self.block_size, upto * self.block_size
        for tensor in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            tensor[lo:hi].zero_()
        self._zeroed_blocks = upto

    def release(self, blocks: Iterable[int]) -> None:
        """Give back the whole pages inside each of `blocks` in every windowed layer's K and V (runs of consecutive
        blocks go as one range); they read as zero from now on. The caller guarantees no windowed layer reads
        those blocks again before they are written again."""
        if not self.release_window:
            return
        span = self.block_bytes
        for first, end in _runs(sorted(set(blocks))):
            lo, hi = whole_pages(first * span, end * span)
            if hi <= lo:
                continue
            for layer in self._windowed:
                for region in self._maps[2 * layer : 2 * layer + 2]:
                    region.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            self.released_bytes_total += 2 * len(self._windowed) * (hi - lo)

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, anonymous: bool) -> torch.Tensor:
        if not anonymous:
            t = torch.empty(shape, dtype=dtype, device=device)
            t[self.num_slots :].zero_()
            return t
        count = math.prod(shape)
        region = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where THP is "always", a first write would commit 2 MiB, not a block
            region.madvise(mmap.MADV_NOHUGEPAGE)
        self._maps.append(region)  # page aligned; the tensor keeps the mapping alive too
        return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block ids as [first, end) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs
