"""Prompt logprobs: the log-probability of every prompt token given the ones before it, from the prefill.

Evaluation tools (lm-evaluation-harness, ...) score a text by the logprobs of its own tokens. The prefill
already computes a hidden state at every prompt position; the LM head normally runs only on the row that
samples. For a sequence whose `SamplingParams.prompt_logprobs` is set, the runner also keeps the rows of
the prompt positions in the chunk (`spans`), after the sampling rows, so requests that do not ask pay
nothing. Row p predicts token p + 1; the first prompt token has no logprob (None), and the last prompt
position is the sampling row itself. `engine.sampling.prompt_logprobs.score` turns those rows into (token logprob,
rank, top-k) with one device-to-host copy. A chunked prefill yields each chunk's positions as it runs; a preempted sequence
recomputes the same values, which simply overwrite (`PromptLogprobs.add`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Span:
    """`count` prompt positions of `item`, from position `first`, whose logits rows this step keeps."""

    item: ScheduledSeq
    first: int
    count: int

    @property
    def offset(self) -> int:
        """Index of the first kept row inside the item's chunk."""
        return self.first - self.item.start


@dataclass(frozen=True, slots=True)
class Scored:
    """One prompt token's logprob, its rank in the distribution (1 = most likely) and the top-k."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def spans(out: SchedulerOutput) -> list[Span]:
    """The prompt positions whose next-token logits this step must keep, in a fixed order."""
    result = []
    for item in out.scheduled:
        if item.seq.params.prompt_logprobs is None:
            continue
        last = min(item.start + item.num_tokens, len(item.seq.prompt_token_ids) - 1)  # exclusive
        if last > item.start:
            result.append(Span(item, item.start, last - item.start))
    return result


class PromptLogprobs:
    """A sequence's prompt logprobs as the chunks come in: entry i is token i's, entry 0 is None."""

    def __init__(self, seq: Sequence) -> None:
        self._entries: list[Scored | None] = [None] * len(seq.prompt_token_ids)

    def add(self, first: int, scored: list[Scored]) -> None:
        """`scored[j]` is the logprob of prompt token first + 1 + j."""
        self._entries[first + 1 : first + 1 + len(scored)] = scored

    @property
    def entries(self) -> list[Scored | None]:
        return self._entries
