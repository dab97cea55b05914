"""The paged KV allocator: which cache blocks belong to which sequence. Pure Python (no torch).

The KV cache tensors (`engine/kv_cache.py`) are split into `num_blocks` blocks of `block_size` token slots.
A sequence owns a list of block ids (its block table); token position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out and takes back fixed-size KV blocks. All operations are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its first `num_tokens` positions have a slot."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` slots for its first `num_tokens` positions; False (and no change) if memory is short."""
        extra = self.extra_blocks_for(seq, num_tokens)
        if extra > len(self._free):
            return False
        seq.block_table.extend(self._free.popleft() for _ in range(extra))
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
