"""Sliding-window layers give back the KV of blocks behind every window (engine/core/block_manager.py `retire`,
`take_released` and the prefix-cache rule for released blocks), with fake model outputs (no torch)."""

from __future__ import annotations

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
BS, W = 4, 6  # block size, window


def seq(rid: str, prompt: list[int], max_tokens: int = 100) -> Sequence:
    return Sequence(rid, 0, list(prompt), GREEDY, max_tokens)


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """`s` has its first n positions computed (blocks grown, published, retired: what a step's update does)."""
    assert bm.grow(s, n)
    s.num_computed_tokens = n
    bm.publish(s)
    bm.retire(s)


def test_blocks_behind_the_window_are_released_once_with_one_block_to_spare() -> None:
    bm = BlockManager(16, BS, window=W)
    s = seq("a", list(range(40)))
    assert bm.allocate(s, [], 0)
    computed(bm, s, 12)  # positions >= 12 + 1 - 6 = 7 still read: block 0 (0-3) is dead, kept one block more
    assert bm.take_released() == []
    computed(bm, s, 13)  # reads from 8 on: blocks 0 and 1 dead; one to spare: block 0 goes
    assert bm.take_released() == [s.block_table[0]]
    assert bm.take_released() == []  # handed over once
    computed(bm, s, 30)  # reads from 25 on: blocks 0-5 dead; 0-4 released
    assert bm.take_released() == s.block_table[1:5] and bm.released_blocks_total == 5
    bm.free(s)
    assert bm.num_used_blocks == 0


def test_no_window_releases_nothing() -> None:
    bm = BlockManager(16, BS)
    s = seq("a", list(range(40)))
    assert bm.allocate(s, [], 0)
    computed(bm, s, 40)
    assert bm.take_released() == [] and bm.released_blocks_total == 0


def test_a_shared_block_is_released_only_when_every_sequence_has_left_it() -> None:
    bm = BlockManager(32, BS, prefix_caching=True, window=W)
    prompt = list(range(100, 140))
    a = seq("a", prompt)
    assert bm.allocate(a, [], 0)
    computed(bm, a, 20)  # reads from 15 on: blocks 0-2 dead, 0-1 released
    assert bm.take_released() == a.block_table[:2]
    b = seq("b", prompt[:16] + [1, 2, 3, 4, 5])  # a hit of a's first 4 blocks: P = 16 reads from 11 on
    prefix = bm.cached_prefix(b)
    assert prefix == a.block_table[:4]
    assert bm.allocate(b, prefix, 16)
    computed(bm, a, 24)  # a has left blocks 0-3 and retires 0-2; b still reads block 2 (positions 8-11)
    assert bm.take_released() == []
    computed(bm, b, 17)  # b reads from 12 on: blocks 0-2 dead for b, 0-1 retired (released already)
    assert bm.take_released() == []
    computed(bm, b, 21)  # b retires block 2 too: both have left it
    assert bm.take_released() == [a.block_table[2]]
    computed(bm, a, 40)  # a retires 3-6; block 3 is b's too, and b still reads it
    assert bm.take_released() == a.block_table[4:7] and b.block_table[3] == a.block_table[3]
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_a_freed_holder_lets_the_others_release() -> None:
    bm = BlockManager(32, BS, prefix_caching=True, window=W)
    prompt = list(range(100, 140))
    a = seq("a", prompt)
    assert bm.allocate(a, [], 0)
    computed(bm, a, 8)
    b = seq("b", prompt[:8] + [1])
    assert bm.allocate(b, bm.cached_prefix(b), 9)  # shares blocks 0 and 1
    computed(bm, b, 9)
    computed(bm, a, 24)  # a has left blocks 0-2; b still reads them
    assert bm.take_released() == [a.block_table[2]]  # block 2 is a's own
    bm.free(b)  # b was the last reader of blocks 0 and 1
    assert sorted(bm.take_released()) == sorted(a.block_table[:2])
    bm.free(a)


def test_a_released_block_handed_out_before_the_cache_saw_it_is_not_given_back() -> None:
    bm = BlockManager(8, BS, window=W)  # no prefix caching: freed blocks go straight back to the free list
    a = seq("a", list(range(40)))
    assert bm.allocate(a, [], 0)
    computed(bm, a, 20)
    first = a.block_table[0]
    bm.free(a)  # released blocks pending, then free
    c = seq("c", list(range(30)))
    assert bm.allocate(c, [], 32)  # takes every block, the pending ones included
    assert first in c.block_table and bm.take_released() == []  # c writes them: they must keep their pages
    bm.free(c)


def test_a_prefix_hit_never_covers_a_released_block_a_window_would_read() -> None:
    """Block i released: a hit of n blocks (computed from P = n * BS on) is usable only when (i + 1) * BS <= P + 1 - W."""
    bm = BlockManager(64, BS, prefix_caching=True, window=W)
    prompt = list(range(100, 124))  # 6 blocks
    a = seq("a", prompt)
    assert bm.allocate(a, [], 0)
    computed(bm, a, 24)  # reads from 19 on: blocks 0-3 dead, 0-2 released
    assert bm.take_released() == a.block_table[:3]
    same = seq("same", prompt)  # the chain is 5 blocks (before the last token): P = 20, windows read from 15 on
    assert bm.cached_prefix(same) == a.block_table[:5]  # block 2 ends at 12 <= 15
    early = seq("early", prompt[:13] + [1, 2])  # chain of 3 blocks: P = 12 reads from 7 on, and block 2 ends at 12
    assert bm.cached_prefix(early) == []  # and no shorter hit helps: each still covers a released block it reads
    later = seq("later", prompt + [7, 8, 9, 1, 2])  # a continuation: a's 6 full blocks, P = 24
    assert bm.cached_prefix(later) == a.block_table[:6]
    bm.free(a)


def test_the_continuation_of_a_finished_sequence_hits_its_whole_prefix() -> None:
    """What the one block to spare is for: a sequence ran n positions and finished; the next turn's prompt holds all
    its tokens, so its hit starts from the block-aligned n; every released block lies behind that hit's windows."""
    for n in range(W + 1, 40):
        bm = BlockManager(64, BS, prefix_caching=True, window=W)
        a = seq("a", list(range(100, 100 + n)))
        assert bm.allocate(a, [], 0)
        computed(bm, a, n)
        bm.free(a)
        turn = seq("turn", list(range(100, 100 + n)) + [1, 2, 3])
        assert len(bm.cached_prefix(turn)) == n // BS, n
