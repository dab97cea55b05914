"""Speculative decoding's pure parts: the n-gram (prompt lookup) proposer, the adaptive switch, the acceptance rule,
the scheduler's verification chunks, and the rejection-sampling argument checked exactly on a small distribution."""

from __future__ import annotations

import random
from fractions import Fraction

from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.speculative import (
    MARGIN,
    PROBE_STEPS,
    Acceptance,
    Adaptive,
    NgramIndex,
    NgramProposer,
    accepted_prefix,
    ngram_propose,
    plan_lengths,
    until_stop,
)
from engine.core.step_cost import StepCost
from engine.types import SamplingParams


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at the start: what followed it
    assert ngram_propose(tokens, 4) == [4, 5, 9, 2]
    # no 3-gram or 2-gram match of (..., 6, 7): the 1-gram 7 matches its earlier occurrence (index 8)
    assert ngram_propose([*tokens, 6, 7], 3) == [8, 1, 2]
    assert ngram_propose([*tokens, 6, 7], 3, min_n=2) == []
    assert ngram_propose([*tokens, 6, 3], 3) == [6, 3]  # the latest occurrence of 3 wins (index 12)
    assert ngram_propose([5, 6, 7], 4) == []  # nothing repeats
    # the proposal stops at the end of the tokens (a match just before the suffix)
    assert ngram_propose([4, 4, 4], 5) == [4]


def test_incremental_index_agrees_with_the_search_from_scratch() -> None:
    rng = random.Random(7)
    for trial in range(200):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        max_n, min_n = rng.choice([(3, 1), (2, 1), (4, 2), (1, 1)])
        index = NgramIndex(max_n, min_n)
        for end in range(1, len(tokens) + 1):  # grown one token at a time, as a sequence is
            k = rng.randrange(1, 7)
            assert index.lookup(tokens[:end], k) == ngram_propose(tokens[:end], k, max_n, min_n), (trial, end)


def test_proposer_follows_a_growing_sequence() -> None:
    seq = Sequence("r", 0, [10, 11, 12, 13, 14, 15], SamplingParams(), max_tokens=20)
    proposer = NgramProposer(3, 1)
    assert proposer.propose(seq, 4) == []  # 15 never occurred before
    seq.output_token_ids += [11, 12]
    assert proposer.propose(seq, 3) == [13, 14, 15]
    seq.output_token_ids += [13]
    assert proposer.propose(seq, 8) == [14, 15, 11, 12, 13]
    proposer.release(seq)
    assert proposer._index == {}


def test_proposal_kind_is_the_match_length_up_to_three() -> None:
    seq = Sequence("r", 0, [1, 2, 3, 4, 5, 6, 7, 9, 4, 5, 6, 7, 8, 3], SamplingParams(), max_tokens=20)
    proposer = NgramProposer(4, 1)
    assert proposer.kind(seq) == 1 and proposer.propose(seq, 2) == [4, 5]  # 3 alone matched
    seq.output_token_ids += [4]
    assert proposer.kind(seq) == 2 and proposer.propose(seq, 2) == [5, 6]  # (3, 4)
    seq.output_token_ids += [5, 6, 7]
    assert proposer.kind(seq) == 3 and proposer.propose(seq, 3) == [8, 3, 4]  # (4, 5, 6, 7): the latest, capped at 3
    seq.output_token_ids += [10]
    assert proposer.kind(seq) is None and proposer.propose(seq, 3) == []  # 10 never occurred before


def test_acceptance_is_tracked_per_kind_and_a_new_sequence_starts_from_the_kind_rate() -> None:
    acc = Acceptance()
    one, long = acc.state("a", 1), acc.state("a", 3)
    assert one is not long and one.alpha == long.alpha == 2 / 3
    for _ in range(6):
        acc.state("a", 1)
        acc.record("a", 3, 0)  # one-token matches fail
        acc.state("a", 3)
        acc.record("a", 5, 5)  # long matches hold
    assert one.alpha < 0.2 and long.alpha > 0.9
    assert acc.rate(1) < 0.3 and acc.rate(3) > 0.8
    # another request starts where the last ones left each kind, not at the prior
    assert abs(acc.state("b", 1).alpha - acc.rate(1)) < 1e-12 and abs(acc.state("b", 3).alpha - acc.rate(3)) < 1e-12
    acc.record("b", 4, 4)  # charged to the kind planned last for "b" (3)
    assert acc.state("b", 3).alpha > acc.rate(1) and acc.state("b", 1).alpha < 0.3
    acc.release("a")
    assert "a" not in acc._states and "a" not in acc._planned
    acc.record("a", 3, 3)  # a released sequence's late verification changes nothing
    assert "a" not in acc._states


class _Kinds:
    """A proposer whose kind per sequence is given; proposing is free."""

    def __init__(self, kinds: dict) -> None:
        self.kinds = kinds

    def kind(self, seq: Sequence) -> int | None:
        return self.kinds[seq.seq_id]

    def token_cost(self, rows: int) -> float:
        return 0.0

    def catchup_cost(self, seq: Sequence) -> float:
        return 0.0


def test_plan_lengths_follows_the_kind_each_sequence_would_get_now() -> None:
    seqs = [Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams(), max_tokens=50) for i in range(3)]
    acc, cost = Acceptance(), StepCost()
    for _ in range(20):
        cost.observe(1, 0.004)
        cost.observe(9, 0.004 + 8 * 0.0008)
    for _ in range(8):  # one-token matches fail, long ones hold
        acc.state("x", 1)
        acc.record("x", 2, 0)
        acc.state("x", 3)
        acc.record("x", 8, 8)
    kinds = {seqs[0].seq_id: 3, seqs[1].seq_id: 1, seqs[2].seq_id: None}
    lengths = plan_lengths([(s, 8) for s in seqs], 3, _Kinds(kinds), cost, acc, 8, 4096)
    assert lengths[0] == 8  # a long match: all 8 pay
    assert lengths[1] == 0  # a one-token match does not pay, nor on average across sequences: not even a try
    assert lengths[2] == 0 and seqs[2].seq_id not in acc._states  # nothing to propose: no state kept
    kinds[seqs[1].seq_id] = 3  # the same sequence with a long match now proposes in full, its 1-gram pause aside
    assert plan_lengths([(seqs[1], 8)], 1, _Kinds(kinds), cost, acc, 8, 4096) == [8]
    for _ in range(8):  # this sequence's long matches now fail, while across sequences they hold
        acc.state(seqs[1].seq_id, 3)
        acc.record(seqs[1].seq_id, 8, 0)
        acc.state("y", 3)
        acc.record("y", 8, 8)
    assert plan_lengths([(seqs[1], 8)], 1, _Kinds(kinds), cost, acc, 8, 4096) == [1]  # a try: they may pay again
    assert plan_lengths([(seqs[1], 8)], 1, _Kinds(kinds), cost, acc, 8, 4096) == [0]  # then a pause


def test_a_proposal_pays_by_a_margin() -> None:
    """A proposal is made when its chance exceeds the rows' share of the step by MARGIN (a tenth of it): at the
    break-even it would gain nothing while its rejections slow every sequence in the step."""
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(), max_tokens=50)
    cost = StepCost()
    for rows in [1, 2, 3, 4] * 20:
        cost.observe(rows, 0.001 + 0.001 * rows)  # one row: half the step, so a chance must exceed 0.55
    # 0.53: not even a try (nor across sequences does it pay); 0.73: a second proposal's 0.53 clears the share, not
    # the bar; 0.76: its 0.58 clears both
    for alpha, want in [(0.53, 0), (0.73, 1), (0.76, 2)]:
        acc = Acceptance()
        acc.state("x", 1)
        acc._rates[1] = [alpha * 1000, 1000.0]  # the kind's rate across sequences
        assert abs(acc.rate(1) - alpha) < 1e-9 and abs(cost.row_share(1) - 0.5) < 1e-6
        assert plan_lengths([(seq, 8)], 1, _Kinds({seq.seq_id: 1}), cost, acc, 8, 4096) == [want]
        acc.release(seq.seq_id)


def test_a_probe_tries_where_a_slow_step_stopped_proposals() -> None:
    """One slow step (a busy machine) at two rows makes a row look as costly as a step: no proposal pays, nor may a
    try be made, and nothing would measure the cost again. After PROBE_STEPS steps without a proposal one is tried
    anyway; its steps set the cost right and proposals pay again."""
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(), max_tokens=500)
    cost, acc = StepCost(), Acceptance()
    acc._rates[3] = [990.0, 1000.0]  # proposals of this kind are kept
    for _ in range(20):
        cost.observe(1, 0.004)
    cost.observe(2, 0.012)
    assert (1 + MARGIN) * cost.row_share(1) >= 1.0

    def plan() -> list[int]:
        return plan_lengths([(seq, 8)], 1, _Kinds({seq.seq_id: 3}), cost, acc, 8, 4096)

    assert [plan() for _ in range(PROBE_STEPS - 1)] == [[0]] * (PROBE_STEPS - 1)
    assert plan() == [1] and acc.unprobed == 0  # the probe
    for _ in range(20):
        cost.observe(2, 0.0045)  # what two rows cost
    assert plan() == [8]


def test_adaptive_verifies_as_many_proposals_as_pay() -> None:
    a = Adaptive()
    assert a.alpha == 2 / 3
    assert a.length(8, row_share=0.25) == 3  # (2/3)^3 > 0.25 > (2/3)^4
    for _ in range(5):
        a.record(5, 5)
    assert a.alpha > 0.9 and a.length(5, 0.25) == 5 and a.length(8, 0.5) >= 6
    assert a.length(2, 0.25) == 2  # never more than asked (k, max_tokens, the context)


def test_adaptive_pauses_a_sequence_whose_proposals_fail_and_retries_with_growing_pauses() -> None:
    a = Adaptive(start_pause=4, max_pause=16)
    for _ in range(4):
        a.record(3, 0)
    assert a.alpha < 0.25
    # not even one proposal pays: a try of one, then a pause of 4 steps, a try, a pause of 8, ...
    assert [a.length(5, 0.25) for _ in range(6)] == [1, 0, 0, 0, 0, 1]
    assert [a.length(5, 0.25) for _ in range(9)] == [0] * 8 + [1]
    assert a.next_pause == 16
    for _ in range(6):
        a.record(1, 1)  # the tries pay again: proposals resume, pauses start over
    assert a.length(5, 0.25) >= 2 and a.pause == 0 and a.next_pause == 4
    a.record(0, 0)  # nothing proposed: nothing learned
    assert a.length(5, 0.25) >= 2


def test_adaptive_proposes_nothing_and_tries_nothing_in_a_step_that_does_not_afford_it() -> None:
    a = Adaptive(start_pause=4, max_pause=16)
    assert a.pays(5, 0.25) == 3 and a.length(5, 0.25, affordable=False) == 0  # it would pay, but not its catch-up
    assert a.pause == 0 and a.next_pause == 4  # nothing tried, nothing learned
    for _ in range(4):
        a.record(3, 0)
    assert a.pays(5, 0.25) == 0 and a.alpha < 0.25
    assert a.length(5, 0.25) == 1 and a.pause == 4  # a try, then a pause of 4
    assert [a.length(5, 0.25, affordable=False) for _ in range(6)] == [0] * 6  # the pause counts down regardless
    assert a.pause == 0 and a.next_pause == 8  # a try is due: it waits for a step that affords it
    assert a.length(5, 0.25, affordable=True) == 1 and a.pause == 8


def test_step_cost_fits_the_fixed_part_and_the_cost_per_row() -> None:
    cost = StepCost(decay=0.99)
    assert cost.row_share(1) == 0.3 / 1.3  # the prior before any step
    for rows in [1, 1, 3, 1, 6, 1, 16, 2, 40, 1] * 20:
        cost.observe(rows, 0.030 + 0.010 * rows)
    fixed, per_row = cost.fit()
    assert abs(fixed - 0.030) < 2e-3 and abs(per_row - 0.010) < 2e-4
    assert abs(cost.row_share(1) - 0.25) < 0.02 and cost.row_share(16) > 0.8
    assert abs(cost.step_time(16) - 0.190) < 5e-3 and StepCost().step_time(16) == 0.0
    flat = StepCost()
    for _ in range(50):
        flat.observe(1, 0.05)  # no spread in rows: the prior's pseudo-point keeps the fit sane
    assert 0.0 < flat.row_share(1) < 0.5


def test_step_cost_prices_a_row_by_the_line_near_the_step_rows() -> None:
    """A CPU step's time as measured on the bundled model (Zen 4, 2 cores): 2.40 ms at one row, 2.73 at two, then
    about a millisecond a row (compute-bound). The line near 16 rows prices a row at what it costs there, the line
    near one row at what the first rows cost (less: the weights are read anyway)."""
    def seconds(rows: int) -> float:
        return {1: 2.40e-3, 2: 2.73e-3}.get(rows, 0.8e-3 + 1.0e-3 * rows)

    cost = StepCost()
    for rows in [1, 2, 3, 1, 4, 6, 8, 12, 16, 16, 14, 20, 24, 32, 2, 1] * 10:
        cost.observe(rows, seconds(rows))
    fixed, per_row = cost.fit(16)
    assert abs(per_row - 1.0e-3) < 0.02e-3 and abs(fixed - 0.8e-3) < 0.2e-3
    assert cost.row_share(16) > 0.93 and abs(cost.step_time(16) - seconds(16)) < 0.1e-3
    assert cost.fit(1)[1] < 0.8e-3 and cost.row_share(1) < 0.4 < cost.row_share(2)
    lone = StepCost()
    for rows in [16] * 20 + [1] * 20:
        lone.observe(rows, seconds(rows))  # near 16 only 16 and the prior's 24: the line through them
    assert lone.fit(16) != lone.fit()


def test_step_cost_prices_a_proposal_among_steps_of_as_many_decodes() -> None:
    """One wave of 16 streams: while all 16 decode, proposals come and go (0-12 rows a step) and each costs 1.02 ms;
    the steps of fewer decodes come later, deeper in the contexts, each row dearer, so the line across row counts
    prices a row under what a proposal adds at 16 decodes. Among the steps of 16 decodes alone the proposals' own
    slope is found, and the step without them; where proposals did not vary (8 decodes, always 3 proposed) the
    line is the price. Steps observed without their decodes leave only the line."""
    def seconds(decodes: int, extra: int, depth: float) -> float:
        return 4.7e-3 + (0.95e-3 + 0.3e-3 * depth) * decodes + 1.02e-3 * extra

    cost = StepCost()
    for i in range(200):  # the wave: 16 decodes near the start of their contexts, proposals varying
        extra = (i * 7) % 13
        cost.observe(16 + extra, seconds(16, extra, 0.2), 16)
    for decodes in range(15, 0, -1):  # then fewer, deeper
        for _ in range(10):
            cost.observe(decodes + 3, seconds(decodes, 3, 1.0), decodes)
    step, per_row = cost.prices(16)
    assert abs(per_row - 1.02e-3) < 1e-6 and abs(step - seconds(16, 0, 0.2)) < 1e-6
    assert cost.fit(16)[1] < 0.99 * per_row  # the line across counts: cheaper than the proposals' own cost
    assert cost.row_share(16) == per_row * 16 / step
    assert cost.proposal_rows(8) is None
    fixed, line = cost.fit(8)
    assert cost.prices(8) == (fixed + line * 8, line)
    blind = StepCost()
    for i in range(200):
        blind.observe(16 + (i * 7) % 13, seconds(16, (i * 7) % 13, 0.2))
    assert blind.proposal_rows(16) is None and blind.prices(16)[1] == blind.fit(16)[1]


def test_step_cost_prices_a_new_count_of_decodes_by_its_neighbour() -> None:
    """A wave's decodes fall one by one: at 15 decodes, before its own steps have varied, a proposed row is priced by
    the steps of 16 decodes (what a proposal adds there), not by the line across row counts, which one stream's
    verifications (many cheap rows) drew flat. Two counts away still counts; further, the line is the price."""
    cost = StepCost()
    for i in range(200):  # one stream: verifications of 1-13 rows, 0.3 ms a row
        cost.observe(1 + i % 13, 2.5e-3 + 0.3e-3 * (1 + i % 13), 1)
    for i in range(40):  # 16 decodes, proposals varying, 0.9 ms a proposed row
        extra = i % 5
        cost.observe(16 + extra, 12e-3 + 0.9e-3 * extra, 16)
    fixed, line = cost.fit(15)
    assert line < 0.8e-3  # the line across counts, the one-stream rows among its points: under the 0.9 ms
    step, per_row = cost.prices(15)
    assert abs(per_row - 0.9e-3) < 1e-9 and step == fixed + line * 15
    assert abs(cost.prices(14)[1] - 0.9e-3) < 1e-9  # two away
    assert cost.prices(13)[1] == cost.fit(13)[1]  # three away: the line
    assert cost.row_share(15) == per_row * 15 / step


def test_proposals_end_where_the_sequence_would() -> None:
    """No row past a proposal that would end the sequence if kept: an EOS (unless it ignores EOS) or a stop token,
    once min_tokens are out (before, a stop token is an ordinary token and what follows it may be kept)."""
    eos = {2}

    def seq(**params: object) -> Sequence:
        s = Sequence("r", 0, [10, 11], SamplingParams(**params), max_tokens=50)
        s.output_token_ids += [20, 21, 22]  # three out: proposal i is output token 3 + i
        return s

    draft = [30, 31, 2, 32, 33]
    assert until_stop(draft, seq(), eos) == [30, 31, 2]
    assert until_stop(draft, seq(ignore_eos=True), eos) == draft
    assert until_stop(draft, seq(ignore_eos=True, stop_token_ids=(31,)), eos) == [30, 31]
    assert until_stop(draft, seq(min_tokens=6), eos) == [30, 31, 2]  # the EOS would be output token 6: a stop
    assert until_stop(draft, seq(min_tokens=7, stop_token_ids=(31, 32)), eos) == [30, 31, 2, 32]  # 31 and 2 too early
    assert until_stop([30, 31], seq(), eos) == [30, 31] and until_stop([], seq(), eos) == []


def test_accepted_prefix() -> None:
    assert accepted_prefix((5, 6, 7), [5, 6, 7, 8]) == 3
    assert accepted_prefix((5, 6, 7), [5, 9, 7, 8]) == 1
    assert accepted_prefix((5, 6, 7), [4, 6, 7, 8]) == 0
    assert accepted_prefix((), [4]) == 0


def test_exact_match_acceptance_is_rejection_sampling_with_a_one_hot_draft() -> None:
    """The engine keeps a proposal t when the token it samples at that position is t, and otherwise emits the
    sampled token. With the sampler's draw (the inverse of the cumulative distribution at a uniform number),
    over a grid of numbers, exactly: P(accept) = p(t), and a rejected position emits p with t removed,
    renormalized: the rule of standard rejection sampling for a draft q = one-hot(t) (accept with probability
    min(1, p(t)/q(t)) = p(t); on reject, draw from max(0, p - q) normalized). The emitted token is p-distributed
    in both cases."""
    p = [Fraction(1, 10), Fraction(3, 10), Fraction(2, 5), Fraction(1, 5)]
    grid = 1000  # uniform numbers (i + 1/2) / grid: every cumulative edge is a multiple of 1/10, so counts are exact
    cdf = [sum(p[: i + 1]) for i in range(len(p))]

    def draw(u: Fraction) -> int:
        return next(i for i, edge in enumerate(cdf) if u < edge)

    for t in range(len(p)):
        accepted, rejected_to = 0, [0] * len(p)
        for i in range(grid):
            token = draw(Fraction(2 * i + 1, 2 * grid))
            if accepted_prefix((t,), [token, -1]) == 1:
                accepted += 1
            else:
                rejected_to[token] += 1
        assert Fraction(accepted, grid) == p[t]
        residual = [0 if j == t else p[j] / (1 - p[t]) for j in range(len(p))]
        assert [Fraction(c, grid - accepted) for c in rejected_to] == residual


def test_scheduler_fits_proposals_to_the_budget_and_the_free_blocks_without_preempting() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=6)
    seq = Sequence("a", 0, [1, 2, 3], SamplingParams(), max_tokens=50)
    sched.add(seq)
    sched.update(sched.schedule(), [7])  # prompt computed; 4 tokens, 3 computed
    seq.draft = [8, 9, 10, 11, 12, 13, 14]
    out = sched.schedule()
    (item,) = out.scheduled
    # the budget (6 tokens) leaves room for 5 proposals; positions 3..8 take 3 blocks
    assert item.draft == (8, 9, 10, 11, 12) and item.num_tokens == 6 and item.samples and item.num_rows == 6
    assert len(seq.block_table) == 3
    sched.update(out, [8])
    assert seq.num_computed_tokens == 4 and seq.num_tokens == 5  # the proposals count only once accepted
    sched.accept(seq, 9)
    assert seq.num_computed_tokens == 5 and seq.output_token_ids == [7, 8, 9]
    seq.draft = []  # the engine clears proposals after each schedule
    # another sequence takes the last free block; a's next proposals fit in the blocks it holds, nobody is preempted
    other = Sequence("b", 0, [1, 2], SamplingParams(), max_tokens=50)
    sched.add(other)
    sched.update(sched.schedule(), [5, 3])
    assert len(other.block_table) == 1 and blocks.num_free_blocks == 0
    seq.draft = [1] * 8
    out = sched.schedule()
    assert not out.preempted and [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    # proposals come after every decode: the budget leaves 4 of them (the blocks a holds would take 5)
    assert out.scheduled[0].draft == (1,) * 4 and out.scheduled[0].num_tokens == 5
    assert out.scheduled[1].num_tokens == 1 and not out.scheduled[1].draft
