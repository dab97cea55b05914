"""The paged KV allocator: which cache blocks belong to which sequence, and which hold a reusable prefix.
Pure Python (no torch).

The KV cache tensors (`engine/model/kv_cache.py`) are split into `num_blocks` blocks of `block_size` token slots.
A sequence owns a list of block ids (its block table); token position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Automatic prefix caching (`prefix_caching=True`): once every position of a full block has its K/V computed,
the block is published under a key that hashes its tokens chained to the previous block's key, so the key
names the whole prefix up to and including that block. A later sequence whose prompt starts with the same
tokens takes those blocks instead of computing them (`cached_prefix` + `allocate`). Blocks carry reference
counts; a block no sequence uses keeps its K/V and its key, and is evicted, least recently used first, only
when a fresh block is needed and none is free. A published block is never written again: a sequence only
writes positions at or after its computed count, and a full computed block lies wholly before it.

Conversations likely to be continued (`SamplingParams.keep_prefix`: a stored Responses turn, which the next turn's
`previous_response_id` extends) leave their cached blocks in a second LRU, evicted only once the first is empty,
so the next turn's prefill covers only its new input even after other traffic. At most `kept_share` of the cache
is held that way; past it the oldest kept blocks go back to the common LRU, first in line.

Sliding-window layers (`window` > 0: the KV cache's `release_window`, the widest window of the model's windowed
layers). A step computing positions from s on reads, in those layers, positions s + 1 - window and later only (the
one-call step's attention, the op-by-op rows and the generic path all start there). So once a sequence has computed
n positions, its blocks that end at or before n + 1 - window are dead for it: `retire(seq)` (after each step) marks
them, keeping one block more than that (so that a continuation of the sequence, or an n > 1 sibling taking its
prompt, still finds its prefix usable, below). A block dead for every sequence that references it is released:
`take_released()` hands it to the KV cache once, which gives back its pages in the windowed layers (they read as
zero). Global layers keep every block, and the block stays in its table, its key and its place in the LRU.
The prefix-cache rule for released blocks: a hit of n blocks (P = n * block_size positions, computed from P on) is
valid only if every released block in it ends at or before P + 1 - window, so no windowed layer of the new
sequence reads it; `cached_prefix` returns the longest such hit (possibly none). A released block handed out afresh
(`_take`) is written again before anything reads it, its pages faulting back in as zeros.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from engine.core.sequence import Sequence

BlockKey = bytes  # sha256 of (parent key, the block's token ids): collisions are not a practical concern


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_key(parent: BlockKey, tokens: list[int]) -> BlockKey:
    """The key of a full block: its tokens chained to its parent's key, so equal keys mean equal prefixes."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Hands out and takes back fixed-size KV blocks. All operations are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, kept_share: float = 0.5,
                 window: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self._kept: OrderedDict[int, None] = OrderedDict()  # the same, of conversations to be continued
        self.max_kept = int(num_blocks * kept_share)
        self._refs = [0] * num_blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}  # published key -> block id
        self.evictions_total = 0
        self.window = window  # sliding-window layers' widest window: blocks behind it are released (0: never)
        self._dead = [0] * num_blocks  # of a block's references, the sequences whose windows have left it
        self._released = [False] * num_blocks  # its windowed layers' pages given back (or about to be)
        self._to_release: dict[int, None] = {}  # released, not yet handed to the KV cache (take_released)
        self.released_blocks_total = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus cached ones nobody uses (evicted on demand)."""
        return len(self._free) + len(self._evictable) + len(self._kept)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published prefix, in use or not."""
        return len(self._cached)

    def extra_blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its first `num_tokens` positions have a slot."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` slots for its first `num_tokens` positions; False (and no change) if memory is short."""
        extra = self.extra_blocks_for(seq, num_tokens)
        if extra > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take() for _ in range(extra))
        return True

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold the start of `seq`, longest chain first found; [] when caching is off.

        Only full blocks before the last token count, so at least one token is left to compute (the step that
        computes it gives the logits to sample from) and that token is written to a block of the sequence's
        own, never into a shared one."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        for key in self._keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        return found[: self._usable(found)]

    def _usable(self, found: list[int]) -> int:
        """The longest start of the cached chain `found` that a sequence may take: each released block in it ends at
        or before P + 1 - window, P the positions taken (the new sequence's windowed layers never read it)."""
        last = [-1] * len(found)  # last[n - 1]: the last released block among found[:n]
        for i, block in enumerate(found):
            last[i] = i if self._released[block] else last[i - 1] if i else -1
        bs = self.block_size
        for n in range(len(found), 0, -1):
            if last[n - 1] < 0 or (last[n - 1] + 1) * bs <= n * bs + 1 - self.window:
                return n
        return 0

    def allocate(self, seq: Sequence, prefix: list[int], num_tokens: int) -> bool:
        """Start the empty block table of `seq` with the cached `prefix` blocks, then grow it to `num_tokens`
        positions; False (and no change) if memory is short. Reusing an unreferenced cached block costs a
        free block, since it is no longer evictable."""
        idle = sum(1 for b in prefix if self._refs[b] == 0)
        fresh = max(0, blocks_needed(num_tokens, self.block_size) - len(prefix))
        if idle + fresh > self.num_free_blocks:
            return False
        for block in prefix:
            if self._refs[block] == 0:
                (self._evictable if block in self._evictable else self._kept).pop(block)
            self._refs[block] += 1
        seq.block_table = list(prefix)
        seq.num_published_blocks = len(prefix)
        seq.num_dead_blocks = 0
        return self.grow(seq, num_tokens)

    def publish(self, seq: Sequence) -> None:
        """Publish the blocks of `seq` that became full and computed. A block whose prefix is already cached
        in another block stays private (freed as usual): the first copy serves later requests."""
        if not self.prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_published_blocks:
            return
        keys = self._keys(seq, full)
        for i in range(seq.num_published_blocks, full):
            block = seq.block_table[i]
            if keys[i] not in self._cached and self._key_of[block] is None:
                self._cached[keys[i]] = block
                self._key_of[block] = keys[i]
        seq.num_published_blocks = full

    def retire(self, seq: Sequence) -> None:
        """Sliding-window layers: mark the blocks of `seq` that its windows have left for good, one block short of
        what they have left (the module docstring), and release those no other sequence still reads."""
        if not self.window:
            return
        dead = min(len(seq.block_table), (seq.num_computed_tokens + 1 - self.window) // self.block_size - 1)
        for i in range(seq.num_dead_blocks, dead):
            block = seq.block_table[i]
            self._dead[block] += 1
            self._release_if_dead(block)
        seq.num_dead_blocks = max(seq.num_dead_blocks, dead)

    def take_released(self) -> list[int]:
        """The blocks released since the last call, for the KV cache to give back their windowed pages."""
        released, self._to_release = list(self._to_release), {}
        return released

    def is_released(self, block: int) -> bool:
        """Whether `block`'s windowed pages were given back since it was last handed out."""
        return self._released[block]

    def _release_if_dead(self, block: int) -> None:
        if not self._released[block] and self._dead[block] == self._refs[block] > 0:
            self._released[block] = True
            self._to_release[block] = None
            self.released_blocks_total += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its last blocks are released first, so the LRU order evicts a prefix's
        tail before its head (the head is what other requests are likeliest to share)."""
        lru = self._kept if seq.params.keep_prefix else self._evictable
        for i in reversed(range(len(seq.block_table))):
            block = seq.block_table[i]
            self._dead[block] -= i < seq.num_dead_blocks
            self._refs[block] -= 1
            if self._refs[block] > 0:
                self._release_if_dead(block)  # the sequences left may all be past it
                continue
            if self._key_of[block] is not None:
                lru[block] = None
            else:
                self._free.append(block)
        overflow = [self._kept.popitem(last=False)[0] for _ in range(len(self._kept) - self.max_kept)]
        for block in reversed(overflow):  # the oldest kept blocks join the common LRU, first to go, in their order
            self._evictable[block] = None
            self._evictable.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_published_blocks = 0
        seq.num_dead_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their sequences)."""
        for block in [*self._evictable, *self._kept]:
            self._free.append(block)
        self._evictable.clear()
        self._kept.clear()
        self._cached.clear()
        self._key_of = [None] * self.num_blocks

    def _take(self) -> int:
        """A block for new K/V: a free one, else the least recently used cached one (a kept conversation's only
        when no other is left), whose key is dropped."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = (self._evictable or self._kept).popitem(last=False)
            key = self._key_of[block]
            self._key_of[block] = None
            if key is not None:
                del self._cached[key]
            self.evictions_total += 1
        self._refs[block] = 1
        self._released[block] = False  # written afresh (a page given back faults in as zeros)
        self._to_release.pop(block, None)  # not yet given back: and now it must not be
        return block

    def _keys(self, seq: Sequence, num_blocks: int) -> list[BlockKey]:
        """The keys of the first `num_blocks` full blocks of `seq` (memoised on the sequence: tokens never
        change, so neither do their keys)."""
        keys = seq.block_keys
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else b"", seq.tokens_in(i * bs, (i + 1) * bs)))
        return keys
