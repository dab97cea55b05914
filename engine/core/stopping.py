"""When a sequence stops, and which text may be streamed before it does. Pure Python (no torch).

Stop strings are never streamed: text that could still be the start of a stop string is held back until the
next token settles it, so a stop string split across tokens is caught before any of it leaves the engine.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from engine.core.sequence import Sequence
from engine.types import FinishReason


@dataclass(frozen=True, slots=True)
class StopDecision:
    reason: FinishReason
    stop_reason: str | int | None = None


def check_token_stop(seq: Sequence, eos_token_ids: Collection[int], max_model_len: int) -> StopDecision | None:
    """Stop checks on the newest token: stop token ids, EOS, max_tokens and the end of the context."""
    params = seq.params
    token = seq.output_token_ids[-1]
    if len(seq.output_token_ids) >= params.min_tokens:
        if token in params.stop_token_ids:
            return StopDecision("stop", token)
        if not params.ignore_eos and token in eos_token_ids:
            return StopDecision("stop", None)
    if len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= max_model_len:
        return StopDecision("length")
    return None


def partial_stop_len(text: str, stops: Collection[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class StopStringMatcher:
    """Feeds text deltas; releases only text that cannot be part of a stop string."""

    def __init__(self, stops: Collection[str], include_stop_str: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop_str
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string that matched or None)."""
        self._pending += delta
        if not self._stops:
            return self.flush(), None
        match = self._earliest_match()
        if match is not None:
            idx, stop = match
            end = idx + len(stop) if self._include else idx
            text, self._pending = self._pending[:end], ""
            return text, stop
        keep = partial_stop_len(self._pending, self._stops)
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, None

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _earliest_match(self) -> tuple[int, str] | None:
        found = [(self._pending.find(s), s) for s in self._stops]
        hits = [(i, s) for i, s in found if i >= 0]
        return min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else None
