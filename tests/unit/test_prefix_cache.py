"""Automatic prefix caching in the block allocator and the scheduler, with fake model outputs (no torch)."""

from __future__ import annotations

import random

from engine.core.block_manager import BlockManager, block_key
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.stopping import check_token_stop
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def seq(rid: str, prompt: list[int], max_tokens: int = 4, index: int = 0,
        params: SamplingParams = GREEDY) -> Sequence:
    return Sequence(rid, index, list(prompt), params, max_tokens)


def fake_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    for s in sched.update(out, [token] * len(out.sampling)):
        if check_token_stop(s, eos_token_ids=(), max_model_len=10_000):
            sched.finish(s, "length")
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(item.seq.request_id, item.start, item.num_tokens) for item in out.scheduled]


def run_to_end(sched: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_work:
            return
        fake_step(sched)
    raise AssertionError("scheduler did not finish")


def caching(num_blocks: int = 32, block_size: int = 4, budget: int = 100, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix_caching=True), max_seqs, budget)


def test_block_keys_chain_the_whole_prefix() -> None:
    a = block_key(b"", [1, 2, 3, 4])
    assert a == block_key(b"", [1, 2, 3, 4]) and a != block_key(b"", [1, 2, 3, 5])
    assert block_key(a, [5, 6, 7, 8]) != block_key(block_key(b"", [9, 9, 9, 9]), [5, 6, 7, 8])


def test_second_request_with_the_same_prefix_computes_only_the_rest() -> None:
    sched = caching()
    system = list(range(100, 112))  # 3 full blocks
    sched.add(seq("a", system + [1, 2]))
    run_to_end(sched)
    assert sched.blocks.num_used_blocks == 0 and sched.blocks.num_cached_blocks == 4  # 3 prompt + 1 with outputs
    sched.add(seq("b", system + [3, 4, 5]))
    assert plan(fake_step(sched)) == [("b", 12, 3)]
    assert sched.prefix_cache_hits_total == 12 and sched.prefix_cache_queries_total == 14 + 15
    b = sched.running[0]
    assert b.num_cached_tokens == 12
    run_to_end(sched)


def test_at_least_one_token_is_computed_and_never_into_a_shared_block() -> None:
    sched = caching()
    prompt = list(range(1, 9))  # exactly 2 blocks
    sched.add(seq("a", prompt))
    run_to_end(sched)
    sched.add(seq("b", prompt))
    out = fake_step(sched)
    assert plan(out) == [("b", 4, 4)]  # the last full block is recomputed into a block of b's own
    b = out.scheduled[0].seq
    first_a_block = sched.blocks.cached_prefix(seq("probe", prompt + [0]))[0]
    assert b.block_table[0] == first_a_block and sched.blocks.num_cached_blocks >= 2
    run_to_end(sched)


def test_running_sequences_share_blocks_and_reference_counts_free_them() -> None:
    bm = BlockManager(16, 4, prefix_caching=True)
    sched = Scheduler(bm, 8, 100)
    prompt = list(range(1, 10))
    sched.add(seq("a", prompt, max_tokens=10))
    fake_step(sched)
    sched.add(seq("b", prompt, max_tokens=10))
    out = fake_step(sched)
    a, b = sched.running
    assert ("b", 8, 1) in plan(out) and a.block_table[:2] == b.block_table[:2]
    sched.abort("a")
    assert b.status == "running" and bm.num_used_blocks == len(b.block_table)  # the shared blocks stay b's
    sched.abort("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16


def test_idle_cached_blocks_are_evicted_lru_only_when_memory_is_needed() -> None:
    bm = BlockManager(6, 2, prefix_caching=True)
    sched = Scheduler(bm, 8, 100)
    sched.add(seq("old", [1, 2, 3, 4, 5], max_tokens=1))
    run_to_end(sched)
    sched.add(seq("new", [9, 8, 7, 6, 5], max_tokens=1))
    run_to_end(sched)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6 and bm.evictions_total == 0
    sched.add(seq("big", list(range(20, 30)), max_tokens=1))  # 5 blocks + its output: needs evictions
    run_to_end(sched)
    assert bm.evictions_total == 3  # 2 free blocks, then 3 evicted
    # "old" finished first, so its blocks went first; "new" released its tail before its head, so its head stays
    assert bm.cached_prefix(seq("p", [1, 2, 3])) == []
    assert len(bm.cached_prefix(seq("p", [9, 8, 7]))) == 1 and bm.cached_prefix(seq("p", [9, 8, 7, 6, 0])) == [
        bm.cached_prefix(seq("p", [9, 8, 7]))[0]]


def test_lru_keeps_the_most_recently_used_prefix() -> None:
    bm = BlockManager(5, 2, prefix_caching=True)
    sched = Scheduler(bm, 8, 100)
    for rid, prompt in (("x", [1, 2, 3]), ("y", [5, 6, 7]), ("x2", [1, 2, 4])):
        sched.add(seq(rid, prompt, max_tokens=1))
        run_to_end(sched)
    # x2 touched x's first block after y ran: y's block is now the least recently used
    sched.add(seq("z", [8, 9, 8, 9, 8, 9, 8], max_tokens=1))  # 4 blocks: one eviction
    run_to_end(sched)
    assert bm.evictions_total == 1
    assert len(bm.cached_prefix(seq("p", [1, 2, 0]))) == 1
    assert bm.cached_prefix(seq("p", [5, 6, 0])) == []


def test_n_siblings_wait_for_the_first_to_compute_the_prompt_then_share_it() -> None:
    sched = caching(budget=8)
    prompt = list(range(1, 15))  # 14 tokens: 3 shareable blocks, two chunks of 8
    for i in range(3):
        sched.add(seq("r", prompt, index=i))
    assert plan(fake_step(sched)) == [("r", 0, 8)]
    assert plan(fake_step(sched)) == [("r", 8, 6)]
    out = fake_step(sched)
    assert plan(out) == [("r", 14, 1), ("r", 12, 2), ("r", 12, 2)]
    first = sched.running[0]
    assert all(s.block_table[:3] == first.block_table[:3] for s in sched.running)
    run_to_end(sched)
    assert sched.blocks.num_used_blocks == 0


def test_off_means_no_sharing_and_no_counting() -> None:
    sched = Scheduler(BlockManager(32, 4), 8, 100)
    prompt = list(range(1, 10))
    sched.add(seq("a", prompt))
    run_to_end(sched)
    sched.add(seq("b", prompt))
    assert plan(fake_step(sched)) == [("b", 0, 9)]
    assert sched.prefix_cache_queries_total == 0 and sched.blocks.num_cached_blocks == 0
    run_to_end(sched)


def test_preempted_sequence_recomputes_from_the_cache() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = seq("old", [1, 2, 3], max_tokens=6), seq("new", [1, 2, 5], max_tokens=6)
    sched.add(old)
    sched.add(new)
    preempted = []
    while sched.has_work:
        preempted += fake_step(sched).preempted
    assert new in preempted and new.num_preemptions >= 1
    assert new.num_cached_tokens == 0  # usage reports the first admission, not the recompute
    assert len(new.output_token_ids) == 6 and len(old.output_token_ids) == 6
    assert sched.prefix_cache_hits_total > 0 and bm.num_used_blocks == 0


def test_random_workload_never_leaks_or_writes_a_shared_block() -> None:
    """Random prompts over a few shared prefixes, random aborts, a memory budget that forces preemption:
    every block ends free or cached, and no scheduled write ever lands in a block another sequence uses."""
    rng = random.Random(17)
    bm = BlockManager(num_blocks=12, block_size=4, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=16)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    rid = 0
    for _ in range(400):
        if rng.random() < 0.3:
            tail = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
            sched.add(seq(f"r{rid}", rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 30)))
            rid += 1
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        out = sched.schedule()
        _assert_writes_are_private(bm, out)
        for s in sched.update(out, [rng.randrange(1, 50) for _ in out.sampling]):
            if check_token_stop(s, eos_token_ids=(), max_model_len=10_000):
                sched.finish(s, "length")
    run_to_end(sched)
    assert sched.preemptions_total > 0 and sched.prefix_cache_hits_total > 0
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert len(bm._free) + len(bm._evictable) == bm.num_blocks == len(set(bm._free) | set(bm._evictable))


def _assert_writes_are_private(bm: BlockManager, out: SchedulerOutput) -> None:
    for item in out.scheduled:
        for pos in range(item.start, item.start + item.num_tokens):
            block = item.seq.block_table[pos // bm.block_size]
            assert bm._refs[block] == 1, "a scheduled write lands in a shared block"
            assert bm._key_of[block] is None, "a scheduled write lands in a published block"


def test_reset_forgets_cached_prefixes() -> None:
    sched = caching()
    sched.add(seq("a", list(range(1, 10))))
    run_to_end(sched)
    assert sched.blocks.num_cached_blocks > 0
    sched.blocks.reset_prefix_cache()
    assert sched.blocks.num_cached_blocks == 0 and sched.blocks.num_free_blocks == 32


def test_a_kept_conversation_outlives_colder_prefixes_within_its_share() -> None:
    """A conversation to be continued (keep_prefix) keeps its cached blocks while other traffic evicts colder
    ones, although it ran first; the kept share bounds it: past it, its oldest blocks are the first to go."""
    keep = SamplingParams(temperature=0.0, keep_prefix=True)
    bm = BlockManager(8, 2, prefix_caching=True, kept_share=0.5)
    sched = Scheduler(bm, 8, 100)
    sched.add(seq("turn1", [1, 2, 3, 4, 5], max_tokens=1, params=keep))  # 2 full blocks published, then kept
    run_to_end(sched)
    for rid, prompt in (("a", [10, 11, 12, 13, 14]), ("b", [20, 21, 22, 23, 24])):  # colder, but later
        sched.add(seq(rid, prompt, max_tokens=1))
        run_to_end(sched)
    sched.add(seq("big", list(range(30, 41)), max_tokens=1))  # 6 blocks: 2 free, then 4 evicted: a's and b's
    run_to_end(sched)
    assert len(bm.cached_prefix(seq("turn2", [1, 2, 3, 4, 5, 6]))) == 2  # the conversation's whole prefix
    assert bm.cached_prefix(seq("p", [10, 11, 0])) == [] and bm.cached_prefix(seq("p", [20, 21, 0])) == []
    plain = BlockManager(8, 2, prefix_caching=True)  # without keep_prefix, LRU alone: turn1 ran first, went first
    sched = Scheduler(plain, 8, 100)
    for rid, prompt in (("turn1", [1, 2, 3, 4, 5]), ("a", [10, 11, 12, 13, 14]), ("b", [20, 21, 22, 23, 24]),
                        ("big", list(range(30, 41)))):
        sched.add(seq(rid, prompt, max_tokens=1))
        run_to_end(sched)
    assert plain.cached_prefix(seq("turn2", [1, 2, 3, 4, 5, 6])) == []
    bounded = BlockManager(8, 2, prefix_caching=True, kept_share=0.25)  # room for 2 kept blocks
    sched = Scheduler(bounded, 8, 100)
    for rid, prompt in (("c1", [1, 2, 3, 4, 5]), ("c2", [6, 7, 8, 9, 5])):
        sched.add(seq(rid, prompt, max_tokens=1, params=keep))
        run_to_end(sched)
    assert len(bounded._kept) == 2 and bounded.num_free_blocks == 8  # c1's blocks moved to the common LRU
    sched.add(seq("x", list(range(50, 59)), max_tokens=1))  # 5 blocks: 4 free, then one evicted: c1's tail
    run_to_end(sched)
    assert len(bounded.cached_prefix(seq("p", [1, 2, 3, 4, 0]))) == 1  # its head is left
    assert len(bounded.cached_prefix(seq("p", [6, 7, 8, 9, 0]))) == 2
