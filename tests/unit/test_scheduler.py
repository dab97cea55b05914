"""Scheduler and block allocator, driven with fake model outputs (no torch, no model)."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.stopping import check_token_stop
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def seq(rid: str, prompt_len: int, max_tokens: int = 100) -> Sequence:
    return Sequence(rid, 0, list(range(1, prompt_len + 1)), GREEDY, max_tokens)


def fake_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step with a fake model: every sampling sequence gets `token`; finishes by max_tokens."""
    out = sched.schedule()
    for s in sched.update(out, [token] * len(out.sampling)):
        decision = check_token_stop(s, eos_token_ids=(), max_model_len=10_000)
        if decision:
            sched.finish(s, decision.reason)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(item.seq.request_id, item.start, item.num_tokens) for item in out.scheduled]


def test_block_manager_grows_and_frees() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq("a", 5)
    assert bm.grow(s, 5) and len(s.block_table) == 2 and bm.num_used_blocks == 2
    assert bm.grow(s, 8) and len(s.block_table) == 2  # still fits in two blocks
    assert not bm.grow(s, 17) and len(s.block_table) == 2  # would need 5 blocks: no partial change
    bm.free(s)
    assert bm.num_used_blocks == 0 and s.block_table == []


def test_admission_is_capped_by_max_num_seqs_first_come_first_served() -> None:
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        sched.add(seq(rid, 3))
    out = fake_step(sched)
    assert plan(out) == [("a", 0, 3), ("b", 0, 3)]
    assert [s.request_id for s in sched.waiting] == ["c"]
    sched.abort("a")
    out = fake_step(sched)
    assert plan(out) == [("b", 3, 1), ("c", 0, 3)]


def test_admission_waits_for_kv_memory_and_nobody_overtakes() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(seq("big", 8, max_tokens=2))  # 2 blocks
    sched.add(seq("huge", 12))  # 3 blocks: must wait for "big"
    sched.add(seq("small", 1))  # would fit, but arrived after "huge"
    assert plan(fake_step(sched)) == [("big", 0, 8)]
    assert [s.request_id for s in sched.waiting] == ["huge", "small"]
    fake_step(sched)  # "big" decodes its second token and finishes
    assert bm.num_used_blocks == 0
    assert plan(fake_step(sched)) == [("huge", 0, 12)]


def test_long_prompt_is_chunked_and_never_stalls_running_decodes() -> None:
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=8)
    sched.add(seq("short", 2))
    fake_step(sched)
    sched.add(seq("long", 20))
    plans = [plan(fake_step(sched)) for _ in range(3)]
    assert plans == [
        [("short", 2, 1), ("long", 0, 7)],
        [("short", 3, 1), ("long", 7, 7)],
        [("short", 4, 1), ("long", 14, 6)],
    ]
    long_seq = next(s for s in sched.running if s.request_id == "long")
    assert long_seq.output_token_ids == [7]  # sampled only when its last chunk ran
    assert all(item.num_tokens == 1 for item in fake_step(sched).scheduled)


def test_preemption_frees_newest_and_resumes_with_recompute() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = seq("old", 3, max_tokens=4), seq("new", 3, max_tokens=4)
    sched.add(old)
    sched.add(new)
    fake_step(sched)  # both prefilled (positions 0-2): 2 blocks each, all 4 used
    fake_step(sched)  # both decode position 3, still inside their 2nd block
    assert bm.num_free_blocks == 0
    out = fake_step(sched)  # old needs a 3rd block for position 4 -> "new" is preempted
    assert [s.request_id for s in out.preempted] == ["new"]
    assert new.status == "waiting" and new.num_computed_tokens == 0 and new.block_table == []
    assert new.output_token_ids == [7, 7] and sched.preemptions_total == 1
    while old.status != "finished":
        fake_step(sched)
    out = fake_step(sched)  # "new" comes back: recomputes prompt + its generated tokens in one chunk
    assert plan(out) == [("new", 0, 5)]
    while sched.has_work:
        fake_step(sched)
    assert new.finish_reason == "length" and len(new.output_token_ids) == 4
    assert bm.num_used_blocks == 0


def test_running_sequence_preempts_itself_when_it_is_the_newest() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = seq("old", 2), seq("new", 2)
    sched.add(old)
    sched.add(new)
    fake_step(sched)  # one block each
    out = fake_step(sched)  # old takes the last free block; new finds none and is itself the newest
    assert plan(out) == [("old", 2, 1)]
    assert out.preempted == [new] and new.status == "waiting" and list(sched.waiting) == [new]
    assert bm.num_used_blocks == 2


def test_abort_frees_memory_immediately_running_and_waiting() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    sched.add(seq("run", 9))
    sched.add(seq("wait", 2))
    fake_step(sched)
    assert bm.num_used_blocks == 3
    aborted = sched.abort("run")
    assert [s.finish_reason for s in aborted] == ["abort"] and bm.num_used_blocks == 0
    assert [s.finish_reason for s in sched.abort("wait")] == ["abort"]
    assert not sched.has_work and sched.abort("missing") == []


def test_finishing_removes_sequence_and_frees_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    s = seq("a", 3, max_tokens=3)
    sched.add(s)
    steps = 0
    while sched.has_work:
        fake_step(sched)
        steps += 1
    assert steps == 3 and s.output_token_ids == [7, 7, 7] and s.finish_reason == "length"
    assert s not in sched.running and bm.num_used_blocks == 0


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError):
        Scheduler(BlockManager(1, 1), max_num_seqs=0, max_num_batched_tokens=1)
    with pytest.raises(ValueError):
        BlockManager(0, 16)
