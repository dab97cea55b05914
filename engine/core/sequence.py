"""One generated sequence: its tokens, its KV blocks and its progress. Pure Python (no torch).

A request with n > 1 becomes n sequences sharing the prompt; each carries its `index`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

from engine.types import FinishReason, SamplingParams

SeqStatus = Literal["waiting", "running", "finished"]

_seq_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """The scheduler's and the engine's view of one sequence.

    `num_computed_tokens` counts tokens whose K/V are in the cache. The sequence samples a new token each
    step in which it becomes fully computed. Preemption (recompute) frees its blocks and resets that count.
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None here
    arrival: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = "waiting"
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # prefix caching (engine.core.block_manager): keys of the full blocks so far, how many of this table's blocks are
    # published (or were taken from the cache), and the prompt tokens found cached when first admitted
    block_keys: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    num_cached_tokens: int = 0
    # sliding-window layers (engine.core.block_manager.retire): the first blocks of this table its windows have left
    num_dead_blocks: int = 0
    # speculative decoding (engine.core.speculative): tokens proposed to follow this sequence, checked in the next
    # step (set by the engine before scheduling, cleared after; the scheduler may shorten it to fit)
    draft: list[int] = field(default_factory=list)

    @property
    def seq_id(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token still needs its K/V computed."""
        return self.num_uncomputed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def token_at(self, position: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        if position < n_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - n_prompt]

    def tokens_in(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:  # a decode step's token: no copy of the whole sequence
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # set when the sequence asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class DraftRow:
    """What the sampler reads of a sequence for one speculative verification row: the sequence as if the proposals
    before this row were already its output (penalties, min_tokens and the row's random number see them)."""

    seq: Sequence
    output_token_ids: list[int]

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def seq_id(self) -> tuple[str, int]:
        return self.seq.seq_id

    @property
    def index(self) -> int:
        return self.seq.index


SampleRow = Sequence | DraftRow  # one logits row's sequence, for the sampler
