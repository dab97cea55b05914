"""Speculative decoding with a draft model (`--speculative draft`): a second, smaller model that shares the target's
tokenizer proposes each decoding sequence's next tokens, greedily; the target checks them in one step
(engine/core/speculative.py has the acceptance rule: with a one-hot draft it is exact, docs/speculative.md).

The draft runs with its own `ModelRunner` and its own paged KV cache (its share of the KV budget: as many tokens as
the target's cache, `kv_share`). Per sequence it keeps a shadow `Sequence`: the target's tokens plus the proposals
of its last turn. Before proposing it catches up on what it has not computed (the prompt the first time, then the
tokens accepted since); positions whose tokens the target did not keep are rolled back by length (K/V at a position
depend only on the tokens up to it, so the computed prefix that still matches stays valid). Then it proposes k
tokens, one draft step each, every sequence that proposes this engine step in the same draft step: on a CPU a
step's cost is mostly reading the weights, so sixteen sequences cost little more than one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.step_cost import StepCost
from engine.model.kv_cache import KVCacheSpec
from engine.model.runner import ModelRunner
from engine.types import SamplingParams

log = logging.getLogger(__name__)

SeqId = tuple[str, int]
_PLAIN = SamplingParams()  # what a shadow sequence says to the runner: no prompt logprobs
_SAMPLE_TOKENS = 512  # token ids compared between the two tokenizers (spread over the vocabulary), plus specials


class VocabularyMismatch(ValueError):
    """The draft model's tokenizer is not the target's: its proposals would be other tokens."""


@dataclass(frozen=True)
class DraftModel:
    """A loaded draft model, handed to the engine by whoever loaded it (models/engine_factory.py)."""

    model: torch.nn.Module
    tokenizer: Any
    max_model_len: int
    name: str = "draft"


def check_same_vocabulary(target: Any, draft: Any) -> None:
    """Refuse a draft whose tokenizer differs from the target's: the same number of tokens, and the same token at
    each of a sample of ids (spread over the vocabulary, and the special tokens)."""
    n_target, n_draft = len(target), len(draft)
    if n_target != n_draft:
        raise VocabularyMismatch(f"the draft model's vocabulary has {n_draft} tokens, the model's {n_target}: "
                                 "a draft model must share the model's tokenizer")
    ids = set(range(0, n_target, max(1, n_target // _SAMPLE_TOKENS))) | {n_target - 1}
    ids |= {i for i in getattr(target, "all_special_ids", []) if 0 <= i < n_target}
    sample = sorted(ids)
    for i, a, b in zip(sample, target.convert_ids_to_tokens(sample), draft.convert_ids_to_tokens(sample), strict=True):
        if a != b:
            raise VocabularyMismatch(f"token {i} is {a!r} for the model and {b!r} for the draft model: a draft "
                                     "model must share the model's tokenizer")


def kv_share(target_spec: KVCacheSpec, draft_spec: KVCacheSpec) -> float:
    """The draft's share of the KV budget so that both caches hold as many tokens (every sequence that proposes
    has its tokens in both)."""
    return draft_spec.bytes_per_token / (target_spec.bytes_per_token + draft_spec.bytes_per_token)


@dataclass(slots=True)
class _Shadow:
    """The draft's view of one target sequence: its tokens as of the last sync plus the proposals since (`seq`,
    whose `num_computed_tokens` counts the positions in the draft's cache), and how many output tokens are known
    to be the target's (`synced`)."""

    seq: Sequence
    synced: int = 0
    proposals: list[int] = field(default_factory=list)


class DraftProposer:
    """`Proposer` (engine/core/speculative.py) over a draft model. `propose_batch` runs up to k draft steps, each
    over every sequence still proposing; `token_cost` is what a proposed token costs a sequence in draft time
    (fitted from the draft's own steps), which the engine's adaptive rule adds to a verification row's cost."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, vocab_size: int, max_model_len: int,
                 max_batched_tokens: int) -> None:
        self.runner = runner
        self.blocks = blocks
        self.vocab_size = vocab_size  # the target's: a draft's padded rows past it are never proposed
        self.max_model_len = max_model_len
        self.max_batched_tokens = max_batched_tokens
        self.cost = StepCost()  # decode-like draft steps: rows = sequences
        self.catchup = StepCost()  # catch-up steps: rows = tokens computed
        self._shadows: dict[SeqId, _Shadow] = {}

    def kind(self, seq: Sequence) -> int | None:
        return 0  # one kind: the draft's greedy continuation

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_batch([(seq, k)])[0]

    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k tokens for each (sequence, k): the draft's greedy continuation. A sequence whose catch-up does
        not fit this step's token budget, or whose slots do not fit the draft's cache, proposes nothing now."""
        shadows: list[_Shadow | None] = [self._ready(seq, k) for seq, k in wants]
        budget = self.max_batched_tokens
        items: list[tuple[_Shadow, int]] = []  # (shadow, proposals wanted) of the sequences that propose
        first: list[ScheduledSeq] = []
        for shadow, (_, k) in zip(shadows, wants, strict=True):
            if shadow is None or budget <= 0:
                continue
            todo = min(shadow.seq.num_uncomputed_tokens, budget)
            budget -= todo
            first.append(ScheduledSeq(shadow.seq, shadow.seq.num_computed_tokens, todo))
            if todo == shadow.seq.num_uncomputed_tokens:
                items.append((shadow, k))
        step, scheduled = 1, first
        while scheduled:
            for (shadow, _), token in zip(items, self._run(scheduled), strict=True):
                shadow.proposals.append(token)
                shadow.seq.output_token_ids.append(token)
            step += 1
            items = [(s, k) for s, k in items if k >= step]
            scheduled = [ScheduledSeq(s.seq, s.seq.num_computed_tokens, 1) for s, _ in items]
        return [list(s.proposals) if s is not None else [] for s in shadows]

    def token_cost(self, rows: int) -> float:
        """Seconds of draft time per proposed token, in a draft step of `rows` sequences (0 before any step)."""
        fixed, per_row = self.cost.fit(rows)
        return fixed / max(rows, 1) + per_row

    def catchup_cost(self, seq: Sequence) -> float:
        """Seconds of draft time to compute the tokens of `seq` that the draft has not, beyond the one or two a
        proposing sequence has each step (already in `token_cost`): its prompt the first time, and every token
        accepted since its last proposal when it stopped proposing. Priced at the catch-up steps' cost per token
        (before any, a decode row's; 0 before any draft step)."""
        behind = self._behind(seq) - 2
        if behind <= 0:
            return 0.0
        per_token = self.catchup.fit()[1] or self.cost.fit()[1]
        return behind * per_token

    def _behind(self, seq: Sequence) -> int:
        """How many of `seq`'s tokens the draft has not computed (an estimate: outputs since the last sync count as
        not computed, though some of them may be accepted proposals the draft computed)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            return seq.num_tokens - len(self._cached_prompt(seq)) * self.blocks.block_size
        known = min(shadow.seq.num_computed_tokens, len(seq.prompt_token_ids) + shadow.synced)
        return seq.num_tokens - known

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.blocks.free(shadow.seq)

    @property
    def num_tracked(self) -> int:
        return len(self._shadows)

    def _ready(self, seq: Sequence, k: int) -> _Shadow | None:
        """The shadow of `seq`, synced with its tokens and with slots for the k - 1 proposals it computes; None
        when it cannot propose (context or cache full: its shadow is then dropped, to start over later)."""
        shadow = self._sync(seq)
        if seq.num_tokens + k - 1 > self.max_model_len or not self.blocks.grow(shadow.seq, seq.num_tokens + k - 1):
            self.release(seq)
            return None
        return shadow

    def _sync(self, seq: Sequence) -> _Shadow:
        """Bring the shadow up to `seq`'s tokens: keep the computed positions whose tokens still match (the
        accepted proposals), roll back the others by length."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = _Shadow(Sequence(seq.request_id, seq.index, seq.prompt_token_ids, _PLAIN, seq.max_tokens))
            shadow.seq.status = "running"
            self._shadows[seq.seq_id] = shadow
            self._take_cached_prefix(shadow.seq)
        mine, real = shadow.seq.output_token_ids, seq.output_token_ids
        same = shadow.synced
        while same < len(mine) and same < len(real) and mine[same] == real[same]:
            same += 1
        del mine[same:]
        mine += real[same:]
        # at least the last token is computed again: its logits give the first proposal (it may have been computed
        # already, as a proposal the target cut short and then sampled itself)
        computed = min(shadow.seq.num_computed_tokens, len(seq.prompt_token_ids) + same, seq.num_tokens - 1)
        shadow.seq.num_computed_tokens = computed
        shadow.synced = len(real)
        shadow.proposals = []
        self.blocks.publish(shadow.seq)  # its computed blocks hold the target's tokens only: no proposal in them
        return shadow

    def _cached_prompt(self, seq: Sequence) -> list[int]:
        """The draft's cached blocks that hold the start of `seq`'s prompt (a second turn's conversation, a shared
        system prompt): whole blocks within the prompt, which its shadow then never writes again."""
        return self.blocks.cached_prefix(seq)[: len(seq.prompt_token_ids) // self.blocks.block_size]

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """A new shadow starts from its prompt's cached blocks, as the target's sequences do."""
        prefix = self._cached_prompt(seq)
        if prefix and self.blocks.allocate(seq, prefix, len(prefix) * self.blocks.block_size):
            seq.num_computed_tokens = len(prefix) * self.blocks.block_size

    def _run(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """One draft step: compute the scheduled positions, return the greedy next token of each item that
        reaches its sequence's end (in order)."""
        started = time.perf_counter()
        logits = self.runner.run(SchedulerOutput(scheduled))  # [sampling items, draft vocab]
        tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        tokens_computed = sum(s.num_tokens for s in scheduled)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_tokens
        seconds = time.perf_counter() - started
        if tokens_computed <= 2 * len(scheduled):  # decode-like steps: prompt catch-ups run another path
            self.cost.observe(tokens_computed, seconds)
        else:
            self.catchup.observe(tokens_computed, seconds)
        return tokens
