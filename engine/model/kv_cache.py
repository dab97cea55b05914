"""The KV cache: one K and one V tensor per layer, allocated once at start, split into paged blocks.

Layout per layer: [(num_blocks + 1) * block_size, kv_heads, head_dim] where slot = block * block_size + offset.
Elements in the model dtype, or as `--kv-cache-dtype` says (`kv_cache_dtype`; float16 halves a float32 model's cache).
The extra last block is kept at zero and is where padded block tables point. The batched decode gathers whole
blocks, so the masked-out tail of a sequence's last block is read too: a mask gives it weight 0, but 0 * NaN
is NaN, so a block is zeroed the first time it is used (`ensure_zeroed`). Allocation uses `torch.empty`, so on
the CPU the OS commits pages only as blocks come into use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.types import DTYPE_BYTES, kv_bytes_per_token

log = logging.getLogger(__name__)

ZERO_STEP_BLOCKS = 64


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for `--kv-cache-dtype name` (engine.types.DTYPE_BYTES' names): auto is the model
    dtype."""
    if name == "auto":
        return model_dtype
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}: use auto, {', '.join(DTYPE_BYTES)}")
    return getattr(torch, name)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

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
        return cls(text.num_hidden_layers, kv_heads, head_dim, dtype)


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
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        shape = (self.num_slots + block_size, spec.num_kv_heads, spec.head_dim)
        self._zeroed_blocks = 0
        self.k = [self._alloc(shape, device) for _ in range(spec.num_layers)]
        self.v = [self._alloc(shape, device) for _ in range(spec.num_layers)]
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d layers)",
            num_blocks, block_size, self.num_slots, self.nbytes / 2**20, spec.dtype, spec.num_layers,
        )

    @property
    def null_block(self) -> int:
        """A block that is always zero: what padded block tables point at."""
        return self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.spec.bytes_per_token

    def ensure_zeroed(self, num_blocks: int) -> None:
        """Zero every block below `num_blocks` that has not been zeroed yet (in steps of 64 blocks)."""
        if num_blocks <= self._zeroed_blocks:
            return
        upto = min(self.num_blocks, max(num_blocks, self._zeroed_blocks + ZERO_STEP_BLOCKS))
        lo, hi = self._zeroed_blocks * self.block_size, upto * self.block_size
        for tensor in (*self.k, *self.v):
            tensor[lo:hi].zero_()
        self._zeroed_blocks = upto

    def _alloc(self, shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
        t = torch.empty(shape, dtype=self.spec.dtype, device=device)
        t[self.num_slots :].zero_()
        return t
