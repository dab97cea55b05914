"""Prompt logprobs: the log-probability of every prompt token given the ones before it, from the prefill.

Evaluation tools (lm-evaluation-harness, ...) score a text by the logprobs of its own tokens. The prefill
already computes a hidden state at every prompt position; the LM head normally runs only on the row that
samples. For a sequence whose `SamplingParams.prompt_logprobs` is set, the runner also keeps the rows of
the prompt positions in the chunk (`spans`), after the sampling rows, so requests that do not ask pay
nothing. Row p predicts token p + 1; the first prompt token has no logprob (None), and the last prompt
position is the sampling row itself. `score` turns those rows into (token logprob, rank, top-k) with one
device-to-host copy. A chunked prefill yields each chunk's positions as it runs; a preempted sequence
recomputes the same values, which simply overwrite (`PromptLogprobs.add`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@torch.inference_mode()
def score(logits: torch.Tensor, step_spans: list[Span]) -> list[list[Scored]]:
    """logits: [sum(span.count), vocab], the spans' rows in order. Returns the scored tokens per span."""
    targets = [t for s in step_spans for t in s.item.seq.prompt_token_ids[s.first + 1 : s.first + 1 + s.count]]
    k = max(s.item.seq.params.prompt_logprobs or 0 for s in step_spans)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    ids = torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None]
    chosen = logprobs.gather(1, ids)  # [rows, 1]
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    parts = [chosen.double(), rank.double()]
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    rows = iter(torch.cat(parts, dim=1).tolist())  # the one device-to-host copy
    out = []
    for s in step_spans:
        asked = s.item.seq.params.prompt_logprobs or 0
        tokens = s.item.seq.prompt_token_ids[s.first + 1 : s.first + 1 + s.count]
        out.append([_unpack(t, next(rows), asked, k) for t in tokens])
    return out


def _unpack(token_id: int, row: list[float], asked: int, k: int) -> Scored:
    top = tuple((int(row[2 + j]), row[2 + k + j]) for j in range(asked))
    return Scored(token_id, row[0], int(row[1]), top)


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
