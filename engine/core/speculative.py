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

Proposers: `NgramProposer` (prompt lookup: no second model). A draft model would be another `Proposer`; the engine
only calls `propose`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.core.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens `seq` is likely to continue with (may be empty)."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget any state kept for `seq` (it finished or was aborted)."""
        ...


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a token list last ended, kept up to date incrementally: proposing
    costs O(max_n) dictionary operations per new token, whatever the length of the sequence."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]  # n -> n-gram -> end index
        self._indexed = 0  # n-grams ending before this index are in `_last`

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The (up to) `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram of
        `tokens` found (n from max_n down to min_n), or []."""
        end = len(tokens) - 1  # the suffix ends here; occurrences ending before it are indexed
        while self._indexed < end:
            i = self._indexed
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self._last[n][tuple(tokens[i - n + 1 : i + 1])] = i
            self._indexed += 1
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            at = self._last[n].get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                return tokens[at + 1 : min(at + 1 + k, end + 1)]
        return []


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
    output; propose the tokens that followed the latest match."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._index: dict[tuple[str, int], tuple[list[int], NgramIndex]] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        entry = self._index.get(seq.seq_id)
        if entry is None:
            entry = self._index[seq.seq_id] = ([], NgramIndex(self.max_n, self.min_n))
        tokens, index = entry
        # the token list grows by appending (prompt, then outputs); copy only what is new
        tokens.extend(seq.tokens_in(len(tokens), seq.num_tokens))
        return index.lookup(tokens, k)

    def release(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)


@dataclass(slots=True)
class Adaptive:
    """Per sequence: whether proposing pays. Each verification feeds (proposed, accepted); the acceptance rate is
    a moving average. When it falls below `floor`, the sequence stops proposing for `pause` steps (doubling at each
    failed retry, up to `max_pause`; reset once proposals pay again), then tries again. A step with no proposal
    (the proposer found nothing) costs nothing and changes nothing."""

    floor: float = 0.3
    weight: float = 0.5  # of the newest verification in the moving average
    start_pause: int = 8
    max_pause: int = 256
    rate: float = 1.0
    pause: int = 0  # steps left without proposals
    next_pause: int = 8

    def wants(self) -> bool:
        """Whether to propose this step (counts a paused step down)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.rate = (1 - self.weight) * self.rate + self.weight * accepted / proposed
        if self.rate >= self.floor:
            self.next_pause = self.start_pause
            return
        self.pause = self.next_pause
        self.next_pause = min(2 * self.next_pause, self.max_pause)
        self.rate = min(1.0, 1.5 * self.floor)  # a retry starts near the floor: one failed step pauses again


def accepted_prefix(draft: list[int] | tuple[int, ...], sampled: list[int]) -> int:
    """How many proposals the sampled rows confirm: the length of the longest prefix where row i's token equals
    proposal i. `sampled` has len(draft) + 1 rows; the tokens kept are sampled[: accepted + 1]."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a
