"""Prompt logprobs on the wire: `echo` + `logprobs` (OpenAI's legacy completions), `max_tokens: 0`, and
vLLM's `prompt_logprobs` extra.

Evaluation tools (lm-evaluation-harness's `local-completions`, ...) send `echo: true, logprobs: k,
max_tokens: 0 or 1` and read `choices[i].logprobs.token_logprobs`, whose entries then cover the prompt
tokens first (`null` for the very first, which has no context) and the generated tokens after them.
`max_tokens: 0` is only meaningful with `echo`: the engine generates one token that is dropped
(`score_only`), so the answer is the prompt, its logprobs and `finish_reason: "length"`.
vLLM's `prompt_logprobs: k` adds `choices[i].prompt_logprobs`: per prompt token `null` (the first) or
`{"<token id>": {"logprob", "rank", "decoded_token"}}` for the token itself and the k most likely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from app.errors import BadRequestError
from app.openai.schemas import PromptLogprobOut
from app.openai.schemas import PromptLogprobs as PromptLogprobsOut
from engine.types import PromptTokenLogprob, RequestOutput


def engine_prompt_logprobs(echo: bool, logprobs: int | None, prompt_logprobs: int | None) -> int | None:
    """What the engine must compute: the echo'd prompt needs `logprobs` alternatives, vLLM's extra its own."""
    wanted = [k for k in (logprobs if echo else None, prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


def engine_max_tokens(max_tokens: int | None, echo: bool) -> int | None:
    """`max_tokens: 0` scores the prompt only: allowed with echo, served as one generated token dropped."""
    if max_tokens != 0:
        return max_tokens
    if not echo:
        raise BadRequestError("max_tokens 0 is only allowed with echo (scoring the prompt).", param="max_tokens")
    return 1


async def score_only(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Hide the one token generated for a `max_tokens: 0` request: no text, no tokens, no logprobs."""
    async for p, out in outputs:
        yield p, dataclasses.replace(
            out, text="", token_ids=[], completion_tokens=0, logprobs=[] if out.logprobs is not None else None,
            finish_reason="length" if out.finished else None, stop_reason=None,
        )


def vllm_prompt_logprobs(entries: Sequence[PromptTokenLogprob | None] | None) -> PromptLogprobsOut | None:
    """vLLM's `prompt_logprobs` shape: per token null or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    out: PromptLogprobsOut = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {str(e.token_id): PromptLogprobOut(logprob=e.logprob, rank=e.rank, decoded_token=e.token)}
        for r, t in enumerate(e.top, start=1):
            ranked.setdefault(str(t.token_id), PromptLogprobOut(logprob=t.logprob, rank=r, decoded_token=t.token))
        out.append(ranked)
    return out


def legacy_prompt_logprobs(entries: Sequence[PromptTokenLogprob | None], first_token: str) -> dict[str, Any]:
    """The prompt part of OpenAI's legacy completions logprobs (`tokens`, `token_logprobs`, `top_logprobs`,
    `text_offset`), offsets from 0; the generated tokens' part follows it. `first_token`: the first prompt
    token's text (it has no logprob entry to carry it)."""
    tokens = [first_token, *(e.token for e in entries[1:] if e is not None)]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": list(tokens),
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {e.token: e.logprob, **{t.token: t.logprob for t in e.top}}
                         for e in entries],
        "text_offset": offsets,
    }


def merge_legacy(prompt_part: dict[str, Any], generated: BaseModel | None) -> dict[str, Any]:
    """Prompt part + the generated tokens' `CompletionLogprobs` (None: nothing generated)."""
    if generated is None:
        return prompt_part
    rest = generated.model_dump()
    return {key: prompt_part[key] + rest[key] for key in prompt_part}


def first_token_text(tokenizer: Any, prompt_ids: Sequence[int]) -> str:
    return tokenizer.decode([prompt_ids[0]], skip_special_tokens=False)


@dataclasses.dataclass(frozen=True, slots=True)
class PromptScoring:
    """What a completions request asked for about its prompts, and how each choice's fields come out."""

    echo_logprobs: bool  # echo + logprobs: the legacy logprobs start with the prompt's tokens
    vllm: bool  # prompt_logprobs: the choice carries vLLM's `prompt_logprobs`
    first_tokens: list[str]  # per prompt: its first token's text

    @classmethod
    def of(cls, tokenizer: Any, prompts: Sequence[Sequence[int]], echo: bool, logprobs: int | None,
           prompt_logprobs: int | None) -> PromptScoring | None:
        if not (echo and logprobs is not None) and prompt_logprobs is None:
            return None
        firsts = [first_token_text(tokenizer, p) for p in prompts] if echo and logprobs is not None else []
        return cls(echo and logprobs is not None, prompt_logprobs is not None, firsts)

    def legacy(self, prompt: int, entries: Sequence[PromptTokenLogprob | None] | None,
               generated: BaseModel | None) -> Any:
        """The choice's legacy `logprobs`: the prompt's part (when echo'd) before the generated part."""
        if not self.echo_logprobs or entries is None:
            return generated
        return merge_legacy(legacy_prompt_logprobs(entries, self.first_tokens[prompt]), generated)

    def vllm_field(self, entries: Sequence[PromptTokenLogprob | None] | None) -> PromptLogprobsOut | None:
        return vllm_prompt_logprobs(entries) if self.vllm else None
