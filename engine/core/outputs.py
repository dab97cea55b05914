"""Per-sequence output state: detokenize, hold back possible stop strings, decide finishing, build deltas."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.prompt_logprobs import PromptLogprobs, Scored
from engine.core.sequence import SampledToken, Sequence
from engine.core.stopping import StopDecision, StopStringMatcher, check_token_stop
from engine.types import PromptTokenLogprob, RequestOutput, TokenLogprob, TopLogprob


class SequenceOutput:
    """Turns each sampled token of one sequence into a `RequestOutput` delta."""

    def __init__(self, seq: Sequence, tokenizer: Any) -> None:
        self.seq = seq
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, seq.params.skip_special_tokens)
        self._stops = StopStringMatcher(seq.params.stop, seq.params.include_stop_str_in_output)
        self._prompt = PromptLogprobs(seq) if seq.params.prompt_logprobs is not None else None
        self._prompt_sent = False

    def add_prompt_logprobs(self, first: int, scored: list[Scored]) -> None:
        if self._prompt is not None:
            self._prompt.add(first, scored)

    def on_token(self, sampled: SampledToken, eos: Collection[int], max_model_len: int,
                 grammar_done: bool = False) -> RequestOutput:
        """Process the token just appended to the sequence; `finish_reason` is set when it ends here.
        `grammar_done`: the sequence's constraint is complete and admits no more text: it stops here."""
        decision = check_token_stop(self.seq, eos, max_model_len)
        hide = decision is not None and decision.reason == "stop" and not self.seq.params.include_stop_str_in_output
        if grammar_done and (decision is None or decision.reason == "length"):
            decision = StopDecision("stop")
        delta = "" if hide else self._detok.add(sampled.token_id)
        if decision is not None:
            delta += self._detok.finish()
        text, matched = self._stops.feed(delta)
        if matched is not None:
            decision = StopDecision("stop", matched)
        elif decision is not None:
            text += self._stops.flush()
        return self._output(text, sampled, decision)

    def aborted(self) -> RequestOutput:
        return RequestOutput(
            self.seq.request_id, self.seq.index, "", [], len(self.seq.prompt_token_ids),
            len(self.seq.output_token_ids), finish_reason="abort", cached_tokens=self.seq.num_cached_tokens,
        )

    def _output(self, text: str, sampled: SampledToken, decision: StopDecision | None) -> RequestOutput:
        return RequestOutput(
            request_id=self.seq.request_id,
            index=self.seq.index,
            text=text,
            token_ids=[sampled.token_id],
            prompt_tokens=len(self.seq.prompt_token_ids),
            completion_tokens=len(self.seq.output_token_ids),
            finish_reason=decision.reason if decision else None,
            stop_reason=decision.stop_reason if decision else None,
            logprobs=[self._logprob(sampled)] if sampled.logprob is not None else None,
            cached_tokens=self.seq.num_cached_tokens,
            prompt_logprobs=self._take_prompt_logprobs(),
        )

    def _take_prompt_logprobs(self) -> list[PromptTokenLogprob | None] | None:
        """The prompt's logprobs, once: on the sequence's first output (the prefill has finished by then)."""
        if self._prompt is None or self._prompt_sent:
            return None
        self._prompt_sent = True
        return [None if e is None else self._prompt_token(e) for e in self._prompt.entries]

    def _prompt_token(self, e: Scored) -> PromptTokenLogprob:
        top = tuple(TopLogprob(t, self._token_text(t), lp) for t, lp in e.top)
        return PromptTokenLogprob(e.token_id, self._token_text(e.token_id), e.logprob, e.rank, top)

    def _logprob(self, sampled: SampledToken) -> TokenLogprob:
        top = tuple(TopLogprob(t, self._token_text(t), lp) for t, lp in sampled.top)
        return TokenLogprob(sampled.token_id, self._token_text(sampled.token_id), sampled.logprob or 0.0, top)

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
