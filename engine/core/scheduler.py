"""Continuous batching: which sequences run this step, and how many of their tokens. Pure Python (no torch).

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Order of service:
1. running sequences that are decoding (one token each), oldest first;
2. running sequences still in prefill, oldest first, each getting as large a chunk as the budget allows,
   so a long prompt is split over several steps instead of stalling the decodes;
3. waiting sequences, first come first served, while the budget, the cap and the free KV blocks allow;
4. speculative proposals of the decodes (engine/core/speculative.py), oldest first, from what is left of the
   budget and the free blocks.
When a running sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (prompt + tokens so far) later.
No request ever fails for lack of KV memory.

With prefix caching on, a waiting sequence first takes the cached blocks that hold the start of its tokens
(`BlockManager.cached_prefix`); it is admitted by the blocks it still needs and computes only the tokens after
that prefix. Blocks are published as they become full and computed, at the end of each step (`update`). The
siblings of an n > 1 request wait at the head of the queue while the first one computes the shared prompt, then
take it from the cache.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.types import FinishReason


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """`num_tokens` positions of `seq`, starting at `start`, get their K/V computed this step."""

    seq: Sequence
    start: int
    num_tokens: int
    # speculative decoding: the proposed tokens that follow the sequence's last token in this chunk (the last
    # len(draft) of its num_tokens positions); each position of a chunk with a draft gets a logits row
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a next token is sampled."""
        return self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def num_rows(self) -> int:
        """Logits rows this item samples from: one per proposal plus one (0 when it does not sample)."""
        return 1 + len(self.draft) if self.samples else 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def sampling(self) -> list[ScheduledSeq]:
        return [s for s in self.scheduled if s.samples]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival, oldest first
        self.preemptions_total = 0
        self.computed_tokens_total = 0  # positions whose K/V the model computed (prefill, recompute and decode)
        self.prefix_cache_queries_total = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits_total = 0  # of those, tokens found cached (not computed)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = "waiting"
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = [s for s in self.running if not s.is_prefill]
        prefilling = [s for s in self.running if s.is_prefill]
        for seq in decoding + prefilling:
            if budget == 0 or seq.status != "running":
                continue
            budget -= self._schedule_running(seq, budget, out)
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        self._add_drafts(out, budget)
        return out

    def update(self, out: SchedulerOutput, sampled: Seq[int]) -> list[Sequence]:
        """Record the computed chunks and the sampled tokens (aligned with `out.sampling`).

        Returns the sequences that received a new token."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens - len(item.draft)  # proposals count once accepted
            self.computed_tokens_total += item.num_tokens
            self.blocks.publish(item.seq)
            self.blocks.retire(item.seq)
        grown = []
        for item, token in zip(out.sampling, sampled, strict=True):
            item.seq.output_token_ids.append(token)
            grown.append(item.seq)
        return grown

    def accept(self, seq: Sequence, token: int) -> None:
        """Speculative decoding: the token last appended to `seq` was a proposal this step computed (its K/V are
        in the cache), and `token` is the sampled token after it."""
        seq.num_computed_tokens += 1
        self.blocks.publish(seq)
        self.blocks.retire(seq)
        seq.output_token_ids.append(token)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End `seq` and free its KV blocks now."""
        if seq.status == "running":
            self.running.remove(seq)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
        seq.status = "finished"
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.blocks.free(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every live sequence of `request_id` with reason "abort"; returns them."""
        seqs = [s for s in self._live() if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def abort_all(self) -> list[Sequence]:
        seqs = list(self._live())
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def _live(self) -> Iterable[Sequence]:
        return [*self.running, *self.waiting]

    def _schedule_running(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule one running sequence, preempting newer ones if blocks run short; returns tokens used."""
        n = min(seq.num_uncomputed_tokens, budget)
        while not self.blocks.grow(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return 0
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
        return n

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Speculative decoding: extend the decodes scheduled this step with their proposals (`Sequence.draft`),
        oldest first, as far as what the step left of its budget and the blocks free now allow. Proposals come
        last: they never take a token of budget or a block from a decode, a prefill chunk or an admission, and
        never preempt anyone."""
        for i, item in enumerate(out.scheduled):
            if budget <= 0:
                return
            seq = item.seq
            if not seq.draft or item.num_tokens != 1 or seq.num_uncomputed_tokens != 1 or seq.status != "running":
                continue
            k = min(len(seq.draft), budget)
            while k > 0 and not self.blocks.grow(seq, item.start + 1 + k):
                k -= 1
            if k > 0:
                out.scheduled[i] = ScheduledSeq(seq, item.start, 1 + k, tuple(seq.draft[:k]))
                budget -= k

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        """Admit waiting sequences while the budget, the cap and the blocks allow; returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._sibling_is_computing_prompt(seq):
                return budget
            # prompt logprobs come from computing the prompt: a request asking for them takes no cached blocks
            prefix = [] if seq.params.prompt_logprobs is not None else self.blocks.cached_prefix(seq)
            cached = len(prefix) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.allocate(seq, prefix, cached + n):
                return budget  # first come first served: nobody overtakes the head of the queue
            self._count_prefix_hit(seq, cached)
            self.waiting.popleft()
            seq.status = "running"
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return budget

    def _count_prefix_hit(self, seq: Sequence, cached: int) -> None:
        seq.num_computed_tokens = cached
        if seq.num_preemptions == 0:  # what the request's usage reports: its first admission
            seq.num_cached_tokens = cached
        if self.blocks.prefix_caching:
            self.prefix_cache_queries_total += seq.num_tokens
            self.prefix_cache_hits_total += cached

    def _sibling_is_computing_prompt(self, seq: Sequence) -> bool:
        """True while a running sibling (same request, n > 1) has yet to compute the full prompt blocks `seq`
        could take from the cache once they are published."""
        if not self.blocks.prefix_caching:
            return False
        shareable = (len(seq.prompt_token_ids) - 1) // self.blocks.block_size * self.blocks.block_size
        return shareable > 0 and any(
            s.request_id == seq.request_id and s.num_computed_tokens < shareable for s in self.running
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = "waiting"
        seq.num_preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(seq)
