"""Speculative decoding's pure-Python half: what to propose, and whether to keep proposing. No torch.

A decoding sequence with proposals (`Sequence.draft`) is scheduled as a small chunk of 1 + k positions: its last
token and the k proposed ones (engine/core/scheduler.py). The step computes their K/V and a logits row at each
position, exactly as a prefill chunk does; the engine samples every row with the sequence's own sampling
parameters as if the proposals before that row were already accepted, and keeps the sampled tokens up to and
including the first that differs from its proposal (`accepted_prefix`). Each kept token is the token plain
decoding would have drawn at that position (same logits, same sampler, the same random number: the sampler's
numbers are indexed by output position), so greedy output is token for token the same, and sampled output has
the target distribution; for a one-token proposal this acceptance rule is standard rejection sampling (accept t
with probability p(t); on rejection, the draw from p conditioned on not t). docs/speculative.md has the argument.

Proposers: `NgramProposer` (prompt lookup: no second model) and `engine.draft.DraftProposer` (a draft model, with
torch: it lives outside core/). The engine only calls `kind`, `propose_batch`, `token_cost`, `catchup_cost` and
`release`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from engine.core.sequence import Sequence
from engine.core.step_cost import StepCost


class Proposer(Protocol):
    def kind(self, seq: Sequence) -> int | None:
        """The kind of proposal `seq` would get now, whose acceptance rate is tracked apart (the n-gram proposer's
        match length: a proposal after a one-token match is kept far less often than one after a longer match);
        None: nothing to propose now."""
        ...

    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, k): up to `k` tokens it is likely to continue with (may be empty). All the sequences
        that propose in an engine step come in one call, so a draft model batches their work."""
        ...

    def token_cost(self, rows: int) -> float:
        """Seconds a proposed token costs to propose, per sequence, when `rows` sequences propose (0: free)."""
        ...

    def catchup_cost(self, seq: Sequence) -> float:
        """Seconds the proposer must spend on `seq` before it can propose beyond what a proposed token costs (a
        draft model that has not computed the sequence's latest tokens; 0: none)."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget any state kept for `seq` (it finished, was aborted or was preempted)."""
        ...


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a token list last ended, kept up to date incrementally: proposing
    costs O(max_n) dictionary operations per new token, whatever the length of the sequence."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]  # n -> n-gram -> end index
        self._indexed = 0  # n-grams ending before this index are in `_last`
        self._found: tuple[int, tuple[int, int] | None] = (-1, None)  # the last match, for a list of that length

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """(n, end) of the latest earlier occurrence of the longest suffix n-gram of `tokens` found (n from max_n
        down to min_n; it ends at index `end`), or None. `tokens` only grows by appending: asked again at the same
        length (a step's `kind`, then its proposal), the answer is the last one."""
        if self._found[0] == len(tokens):
            return self._found[1]
        found = self._match(tokens)
        self._found = (len(tokens), found)
        return found

    def _match(self, tokens: list[int]) -> tuple[int, int] | None:
        end = len(tokens) - 1  # the suffix ends here; occurrences ending before it are indexed
        while self._indexed < end:
            i = self._indexed
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self._last[n][tuple(tokens[i - n + 1 : i + 1])] = i
            self._indexed += 1
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            at = self._last[n].get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                return n, at
        return None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The (up to) `k` tokens that followed that occurrence (`match`), or []."""
        found = self.match(tokens)
        return [] if found is None else tokens[found[1] + 1 : min(found[1] + 1 + k, len(tokens))]


def ngram_propose(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """`NgramIndex.lookup` from scratch (the reference the tests compare the incremental index with)."""
    end = len(tokens) - 1
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for i in range(end - 1, n - 2, -1):
            if tokens[i - n + 1 : i + 1] == suffix:
                return tokens[i + 1 : min(i + 1 + k, end + 1)]
    return []


class NgramProposer:
    """Prompt lookup: match the sequence's last n tokens (n = max_n down to min_n) against its own prompt and
    output; propose the tokens that followed the latest match. Its `kind` is the match's length, up to
    `KINDS`: on input-grounded and open chat (the bundled model, greedy), the first token after a one-token match
    was kept 17-27% of the time, after a two-token match 49-91%, after a longer one 64-100%."""

    KINDS = 3

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._index: dict[tuple[str, int], tuple[list[int], NgramIndex]] = {}

    def _match(self, seq: Sequence) -> tuple[list[int], tuple[int, int] | None]:
        entry = self._index.get(seq.seq_id)
        if entry is None:
            entry = self._index[seq.seq_id] = ([], NgramIndex(self.max_n, self.min_n))
        tokens, index = entry
        # the token list grows by appending (prompt, then outputs); copy only what is new
        tokens.extend(seq.tokens_in(len(tokens), seq.num_tokens))
        return tokens, index.match(tokens)

    def kind(self, seq: Sequence) -> int | None:
        found = self._match(seq)[1]
        return None if found is None else min(found[0], self.KINDS)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        tokens, found = self._match(seq)
        return [] if found is None else tokens[found[1] + 1 : min(found[1] + 1 + k, len(tokens))]

    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose(seq, k) for seq, k in wants]

    def token_cost(self, rows: int) -> float:
        return 0.0  # a few dictionary operations

    def catchup_cost(self, seq: Sequence) -> float:
        return 0.0  # the index catches up in microseconds

    def release(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)


MARGIN = 0.1  # a proposal pays when its chance exceeds the rows' share by a tenth (see plan_lengths)
PROBE_STEPS = 64  # after so many steps without a proposal, one sequence tries one anyway (see plan_lengths)


@dataclass(slots=True)
class Adaptive:
    """Per sequence: how many proposals pay. `alpha` estimates the chance that a proposal is accepted given that
    the one before it was (verifications' accepted and tried proposals, older ones forgotten geometrically, from a
    prior of 2 in 3). The j-th proposal is accepted with chance alpha^j and costs one row; a row pays when that
    chance exceeds the share of the step rows cost (`StepCost.row_share`: one token per row is what decoding
    yields). When not even one proposal pays, the sequence stops proposing for `pause` steps, then tries one
    (pauses double on each failed try up to `max_pause`, and start over once proposals pay). A step in which
    proposing is not `affordable` (the engine's call: a draft model's catch-up would cost more than proposals could
    gain, `_affordable`) proposes nothing and only counts a pause down; a try then waits for a step
    that affords it."""

    decay: float = 0.8
    hits: float = 2.0
    tries: float = 3.0
    start_pause: int = 4
    max_pause: int = 128
    pause: int = 0  # steps left without proposals
    next_pause: int = 4

    @property
    def alpha(self) -> float:
        return self.hits / self.tries

    def pays(self, k: int, row_share: float) -> int:
        """How many of up to `k` proposals pay at this acceptance rate (no state changes)."""
        n, chance = 0, self.alpha
        while n < k and chance > row_share:
            n += 1
            chance *= self.alpha
        return n

    def length(self, k: int, row_share: float, affordable: bool = True, may_try: bool = True,
               probe: bool = False) -> int:
        """How many of up to `k` proposals to verify this step (0: none; counts a paused step down). A try waits
        while not `may_try` (the engine's call: where proposals of its kind do not pay on average); a `probe` is a
        try made now, paused or not."""
        n = self.pays(k, row_share) if affordable else 0
        if n > 0:
            self.pause, self.next_pause = 0, self.start_pause
            return n
        if self.pause > 0 and not probe:
            self.pause -= 1
            return 0
        if not (affordable and (may_try or probe)):
            return 0  # a try is due, and waits for a step that affords it
        self.pause = self.next_pause
        self.next_pause = min(2 * self.next_pause, self.max_pause)
        return 1  # a try: one proposal, to learn whether they pay again

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of `proposed` proposals kept `accepted` (each kept one was tried after a kept one)."""
        if proposed <= 0:
            return
        self.hits = self.decay * self.hits + accepted
        self.tries = self.decay * self.tries + accepted + (1 if accepted < proposed else 0)


class Acceptance:
    """The adaptive rule's state: each sequence's `Adaptive` per kind of proposal (`Proposer.kind`), and per kind
    across sequences the acceptance rate a sequence's first proposals of that kind start from (older verifications
    forgotten geometrically, from the prior of 2 in 3), so a new request does not relearn what the last ones
    showed. `plan_lengths` notes the kind it planned for each sequence; `record` charges that kind."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._states: dict[object, dict[int, Adaptive]] = {}
        self._rates: dict[int, list[float]] = {}  # kind -> [hits, tries] across sequences
        self._planned: dict[object, int] = {}
        self.unprobed = 0  # steps since the last probe (plan_lengths)

    def state(self, seq_id: object, kind: int) -> Adaptive:
        states = self._states.setdefault(seq_id, {})
        found = states.get(kind)
        if found is None:
            hits, tries = self._rates.get(kind, (2.0, 3.0))
            found = states[kind] = Adaptive(hits=3.0 * hits / tries, tries=3.0)
        self._planned[seq_id] = kind
        return found

    def rate(self, kind: int) -> float:
        hits, tries = self._rates.get(kind, (2.0, 3.0))
        return hits / tries

    def record(self, seq_id: object, proposed: int, accepted: int) -> None:
        """A verification of `seq_id`'s proposals of the kind planned last kept `accepted` of `proposed`."""
        kind = self._planned.get(seq_id)
        if kind is None or proposed <= 0:
            return
        self._states[seq_id][kind].record(proposed, accepted)
        rate = self._rates.setdefault(kind, [2.0, 3.0])
        rate[0] = self.decay * rate[0] + accepted
        rate[1] = self.decay * rate[1] + accepted + (1 if accepted < proposed else 0)

    def release(self, seq_id: object) -> None:
        self._states.pop(seq_id, None)
        self._planned.pop(seq_id, None)


def until_stop(draft: list[int], seq: Sequence, eos: Collection[int]) -> list[int]:
    """`draft` up to and including the first proposal that would end `seq` if kept (a stop token, or an EOS unless it
    ignores EOS, once `min_tokens` are out): nothing after it could be kept, so verifying it would cost rows for
    nothing. Proposal i is the candidate for output token len(output) + i."""
    params, done = seq.params, len(seq.output_token_ids)
    for i, token in enumerate(draft):
        if done + i + 1 >= params.min_tokens and (
                token in params.stop_token_ids or (not params.ignore_eos and token in eos)):
            return draft[: i + 1]
    return draft


def accepted_prefix(draft: list[int] | tuple[int, ...], sampled: list[int]) -> int:
    """How many proposals the sampled rows confirm: the length of the longest prefix where row i's token equals
    proposal i. `sampled` has len(draft) + 1 rows; the tokens kept are sampled[: accepted + 1]."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a


def plan_lengths(candidates: list[tuple[Sequence, int]], rows: int, proposer: Proposer, step_cost: StepCost,
                 acceptance: Acceptance, k: int, max_model_len: int) -> list[int]:
    """How many proposals each (sequence, room) verifies in a step of `rows` decodes (`Adaptive.length`, the
    sequence's state for the kind of proposal it would get now; none where it has nothing to propose): as many as
    pay given its acceptance rate for that kind, what a row costs (`step_cost`) and what a proposed token costs the
    proposer in a step of as many proposing sequences (a draft model's step: its fixed part is shared by the
    sequences that propose, not by every decode), and none, not even a try, while proposing would not pay for the
    proposer's catch-up (`_affordable`). A proposal pays when its chance exceeds the rows' share by MARGIN: at the
    break-even it gains nothing on average, while its rejections slow every sequence in the step (the one that
    ends last among them) and its bookkeeping costs every step; and a due try waits while proposals of its kind do
    not pay on average across sequences (`Acceptance.rate`). Where the bar is 1 or more (a row costs nearly what
    it yields: a compute-bound step of many rows), nothing is weighed at all. What no one tries is not measured
    again, so a cost or a rate that noise set too high (a busy machine's slow steps) would stop proposals for
    good: after PROBE_STEPS steps without a proposal one sequence tries one whatever the bar (a probe)."""
    bar = _bar(rows, rows, proposer, step_cost)
    acceptance.unprobed += 1
    probe = acceptance.unprobed >= PROBE_STEPS
    if bar >= 1.0 and not probe:  # not even a proposal sure to be kept pays (nor may a try be made)
        return [0] * len(candidates)
    kinds = [proposer.kind(seq) for seq, _ in candidates]
    states = [acceptance.state(seq.seq_id, kind) for (seq, _), kind in zip(candidates, kinds, strict=True)
              if kind is not None]
    candidates = [c for c, kind in zip(candidates, kinds, strict=True) if kind is not None]
    if not candidates:
        return [0] * len(kinds)
    kind_rates = [acceptance.rate(kind) for kind in kinds if kind is not None]
    rates = [rate > bar for rate in kind_rates]  # may a due try be made
    proposing = sum(1 for a, (_, room), may in zip(states, candidates, rates, strict=True)
                    if (a.pause == 0 and may) or a.pays(room, bar))
    if 0 < proposing < rows:  # the proposer's step is shared by fewer sequences than decode
        bar = _bar(rows, proposing, proposer, step_cost)
        rates = [rate > bar for rate in kind_rates]
    saving = _saving(rows, proposing, proposer, step_cost)
    lengths = [a.length(room, bar, _affordable(seq, a, saving, proposer, k, max_model_len), may)
               for a, (seq, room), may in zip(states, candidates, rates, strict=True)]
    if probe and not any(lengths):  # one sequence tries, paused or not
        (seq, room), a = candidates[0], states[0]
        lengths[0] = a.length(room, bar, _affordable(seq, a, saving, proposer, k, max_model_len), probe=True)
    if any(lengths):
        acceptance.unprobed = 0
    found = iter(lengths)
    return [0 if kind is None else next(found) for kind in kinds]


def _bar(rows: int, proposing: int, proposer: Proposer, step_cost: StepCost) -> float:
    """The chance a proposal must exceed to pay in a step of `rows` decodes, `proposing` of them proposing: the
    rows' share of the step (a row and the proposer's token) and MARGIN over it."""
    return (1 + MARGIN) * step_cost.row_share(rows, proposer.token_cost(proposing))


def _saving(rows: int, proposing: int, proposer: Proposer, step_cost: StepCost) -> float | None:
    """Seconds a proposal that is kept saves its sequence in a step of `rows` decodes, `proposing` of them
    proposing: what a decoded token costs (the step's time over its rows) less what a proposal costs (a row, and the
    proposer's token). None before the step's cost is known."""
    step, per_row = step_cost.prices(rows)
    if step == 0.0:
        return None
    return step / rows - per_row - proposer.token_cost(max(proposing, 1))


def _affordable(seq: Sequence, adaptive: Adaptive, saving: float | None, proposer: Proposer, k: int,
                max_model_len: int) -> bool:
    """Whether `seq` may propose this step given what the proposer must first catch up on (a draft model's prompt
    the first time, every token since its last proposal after a pause): the most that proposals could save over its
    remaining tokens (each step k proposals, kept with its acceptance rate) must exceed it. Then a draft that does
    not pay costs nothing: where even a kept proposal saves nothing (`saving` <= 0: a draft step costs more than a
    decoded token), nothing is proposed or tried, and after a pause a try is made only while the catch-up it needs
    is worth its chance."""
    if saving is None:
        return True  # no step timed yet: propose as the acceptance prior says, and learn
    if saving <= 0.0:
        return False
    catchup = proposer.catchup_cost(seq)
    if catchup == 0.0:
        return True
    left = min(seq.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens)
    return catchup < adaptive.alpha * left * k / (k + 1) * saving
