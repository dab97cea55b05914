"""The OpenAI API's one converter: wire request -> (prompt token ids, SamplingParams), engine outputs -> wire.

`to_sampling_params` is the only place an OpenAI request becomes engine `SamplingParams`; `chat_plan` and
`completion_plan` hand the request to the request plan every family shares (`app/chat/plan.py`). The prompt side
(chat template, raw prompts) is `app/chat/prompts.py`, shared with the Llama Stack routes. The output side folds engine `RequestOutput`s into the non-stream response objects
(`ChatResult`, `CompletionResult`) or maps them to stream chunks (`chat_chunks`, `completion_chunks`).
No generation logic lives here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.chat import structured
from app.chat.plan import PlanRequest, ToolsRequest
from app.chat.prompt_logprobs import (
    PromptScoring,
    engine_max_tokens,
    engine_prompt_logprobs,
    vllm_prompt_logprobs,
)
from app.chat.prompts import check_token_ids
from app.chat.tools import NamedChoice
from app.errors import BadRequestError
from app.openai.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    TokenLogprobOut,
    TopLogprobOut,
    Usage,
)
from engine.types import MAX_LOGPROBS, RequestOutput, SamplingParams, TokenLogprob

NO_DEFAULTS: Mapping[str, float] = {}

# ---------------------------------------------------------------- request -> engine


def chat_plan(req: ChatCompletionRequest, vocab_size: int, defaults: Mapping[str, float] = NO_DEFAULTS) -> PlanRequest:
    """A chat request as the shared request plan's input (`app/chat/plan.py`); `defaults` fill the sampling keys
    it leaves out (`--override-generation-config`, `app.deps.generation_defaults`)."""
    params = to_sampling_params(req, vocab_size, defaults)
    return PlanRequest(params, structured.field_of(req), tools_request(req), conversations=[req.messages],
                       template_kwargs=template_kwargs(req))


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The request's chat template variables: `chat_template_kwargs` (vLLM's extension: Qwen3's `enable_thinking`,
    ...) and `reasoning_effort` (gpt-oss's template reads it)."""
    effort = {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort is not None else {}
    return {**(req.chat_template_kwargs or {}), **effort}


def completion_plan(
    req: CompletionRequest, vocab_size: int, prompt_ids: Sequence[list[int]], defaults: Mapping[str, float] = NO_DEFAULTS
) -> PlanRequest:
    """A completion request (its prompts already token ids) as the shared request plan's input."""
    return PlanRequest(to_sampling_params(req, vocab_size, defaults), structured.field_of(req), prompt_ids=prompt_ids)


def tools_request(req: ChatCompletionRequest) -> ToolsRequest:
    """`tools`, `tool_choice` and `parallel_tool_calls` as the family-neutral ToolsRequest."""
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    named = choice if isinstance(choice, str) or choice is None else NamedChoice(choice.function.name)
    return ToolsRequest(functions, named, req.parallel_tool_calls is not False)


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, vocab_size: int, defaults: Mapping[str, float] = NO_DEFAULTS
) -> SamplingParams:
    """The one OpenAI request -> SamplingParams conversion (chat and completions alike). A sampling key the
    request leaves out takes the server's default (`defaults`), else OpenAI's."""

    def given(name: str, value: float | None, fallback: float | None) -> float | None:
        return value if value is not None else defaults.get(name, fallback)

    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    max_tokens = None if (limit := given("max_tokens", max_tokens, None)) is None else int(limit)
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise BadRequestError(
            f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens}).", param="min_tokens"
        )
    echo = isinstance(req, CompletionRequest) and req.echo
    logprobs = _logprobs(req)
    return SamplingParams(
        n=_n(req),
        temperature=given("temperature", req.temperature, 1.0),
        top_p=given("top_p", req.top_p, 1.0),
        top_k=max(int(given("top_k", req.top_k, 0) or 0), 0),
        min_p=given("min_p", req.min_p, 0.0) or 0.0,
        repetition_penalty=given("repetition_penalty", req.repetition_penalty, 1.0) or 1.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        seed=req.seed,
        max_tokens=engine_max_tokens(max_tokens, echo),
        min_tokens=req.min_tokens,
        stop=_stop(req.stop),
        stop_token_ids=tuple(check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        prompt_logprobs=engine_prompt_logprobs(echo, logprobs, req.prompt_logprobs),
        constraint=structured.constraint_of(req),
    )


def _n(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of != req.n:
        raise BadRequestError("best_of is not supported unless it equals n.", param="best_of")
    return req.n


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequestError(
                f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
            ) from None
        if not -100.0 <= value <= 100.0:
            raise BadRequestError(
                f"logit_bias values must be in [-100, 100], got {value}.", param="logit_bias"
            )
        out[token_id] = value
    check_token_ids(list(out), vocab_size, "logit_bias")
    return out


def _logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is None or req.logprobs is False:
        return None
    k = 1 if req.logprobs is True else req.logprobs
    if not 0 <= k <= MAX_LOGPROBS:
        raise BadRequestError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {k}.", param="logprobs")
    return k


# ---------------------------------------------------------------- engine -> wire: logprobs


def _top(tl: TokenLogprob) -> list[TopLogprobOut]:
    return [TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token.encode())) for t in tl.top]


def chat_logprobs(lps: Sequence[TokenLogprob] | None) -> ChatLogprobs | None:
    if lps is None:
        return None
    content = [
        TokenLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()), top_logprobs=_top(t))
        for t in lps
    ]
    return ChatLogprobs(content=content)


def completion_logprobs(lps: Sequence[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
    """OpenAI's legacy shape; `offset` is where the first token's text starts in the choice's text."""
    if lps is None:
        return None
    tokens, offsets = [], []
    for t in lps:
        tokens.append(t.token)
        offsets.append(offset)
        offset += len(t.token)
    tops: list[dict[str, float] | None] = [
        {t.token: t.logprob, **{a.token: a.logprob for a in t.top}} for t in lps
    ]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[t.logprob for t in lps], top_logprobs=tops, text_offset=offsets
    )


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """`cached_tokens`: prompt tokens the prefix cache supplied (per prompt, as its first sequence saw it:
    with n > 1 the siblings share the prompt the first one computed, and the prompt is counted once)."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


@dataclass(slots=True)
class _Seq:
    """What one choice has accumulated so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    text_len: int = 0
    prompt_logprobs: list | None = None  # engine PromptTokenLogprob entries, from the first output

    def add(self, out: RequestOutput) -> None:
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
        self.text.append(out.text)
        self.text_len += len(out.text)
        self.logprobs.extend(out.logprobs or ())
        self.completion_tokens = out.completion_tokens
        self.finish_reason = out.finish_reason or self.finish_reason


# ---------------------------------------------------------------- engine -> wire: chat


@dataclass(slots=True)
class ChatResult:
    """Folds the outputs of one chat request into the non-stream response."""

    id: str
    model: str
    n: int
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seqs: dict[int, _Seq] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens = out.prompt_tokens
        if out.index == 0:
            self.cached_tokens = out.cached_tokens
        self.seqs.setdefault(out.index, _Seq()).add(out)

    def response(self) -> ChatCompletionResponse:
        choices = [self._choice(i, self.seqs.get(i, _Seq())) for i in range(self.n)]
        completion = sum(s.completion_tokens for s in self.seqs.values())
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=_usage(self.prompt_tokens, completion, self.cached_tokens),
            prompt_logprobs=vllm_prompt_logprobs(self.seqs[0].prompt_logprobs) if 0 in self.seqs else None,
        )  # fmt: skip

    def _choice(self, i: int, seq: _Seq) -> ChatChoice:
        logprobs = chat_logprobs(seq.logprobs) if self.want_logprobs else None
        message = AssistantMessage(content="".join(seq.text))
        return ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=seq.finish_reason)


async def chat_chunks(
    outputs: AsyncIterator[tuple[int, RequestOutput]], *, id: str, model: str, n: int, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """Stream events of one chat request: a role chunk per choice, content deltas, optional usage chunk."""
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        return ChatCompletionChunk(
            id=id, created=created, model=model, choices=choices, usage=usage
        ).model_dump()

    for i in range(n):
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    prompt_tokens, completion, cached = 0, {}, 0
    async for _, out in outputs:
        prompt_tokens, completion[out.index] = out.prompt_tokens, out.completion_tokens
        cached = out.cached_tokens if out.index == 0 else cached
        if out.text or out.logprobs or out.finished:
            delta = DeltaMessage(content=out.text or None)
            lp = chat_logprobs(out.logprobs) if out.logprobs is not None else None
            yield chunk(
                [ChatChunkChoice(index=out.index, delta=delta, logprobs=lp, finish_reason=out.finish_reason)]
            )
    if include_usage:
        yield chunk([], _usage(prompt_tokens, sum(completion.values()), cached))


# ---------------------------------------------------------------- engine -> wire: completions


@dataclass(slots=True)
class CompletionResult:
    """Folds the outputs of one completions request (maybe several prompts x n) into the response."""

    id: str
    model: str
    n: int
    prompt_texts: list[str]  # what `echo` prepends, per prompt ("" when echo is off)
    want_logprobs: bool
    scoring: PromptScoring | None = None  # echo + logprobs, or vLLM's prompt_logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    seqs: dict[int, _Seq] = field(default_factory=dict)

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = out.prompt_tokens
        if out.index == 0:
            self.cached_tokens[prompt_index] = out.cached_tokens
        self.seqs.setdefault(prompt_index * self.n + out.index, _Seq()).add(out)

    def response(self) -> CompletionResponse:
        choices = [self._choice(c) for c in range(len(self.prompt_texts) * self.n)]
        completion = sum(s.completion_tokens for s in self.seqs.values())
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=_usage(sum(self.prompt_tokens.values()), completion, sum(self.cached_tokens.values())),
        )  # fmt: skip

    def _choice(self, c: int) -> CompletionChoice:
        seq, echo = self.seqs.get(c, _Seq()), self.prompt_texts[c // self.n]
        logprobs = completion_logprobs(seq.logprobs, len(echo)) if self.want_logprobs else None
        prompt_lps = None
        if self.scoring is not None:
            logprobs = self.scoring.legacy(c // self.n, seq.prompt_logprobs, logprobs)
            prompt_lps = self.scoring.vllm_field(seq.prompt_logprobs)
        return CompletionChoice(
            index=c, text=echo + "".join(seq.text), logprobs=logprobs, finish_reason=seq.finish_reason,
            prompt_logprobs=prompt_lps,
        )


async def completion_chunks(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    *,
    id: str,
    model: str,
    n: int,
    prompt_texts: list[str],
    include_usage: bool,
    scoring: PromptScoring | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Stream events of one completions request; `echo` text goes out with a choice's first chunk."""
    created = int(time.time())
    offsets: dict[int, int] = {}  # text emitted so far per choice (for logprobs' text_offset)
    prompt_tokens: dict[int, int] = {}
    completion: dict[int, int] = {}
    cached: dict[int, int] = {}
    async for p, out in outputs:
        c = p * n + out.index
        prompt_tokens[p], completion[c] = out.prompt_tokens, out.completion_tokens
        if out.index == 0:
            cached[p] = out.cached_tokens
        echo = prompt_texts[p] if c not in offsets else ""
        offset = offsets.get(c, 0) + len(echo)
        offsets[c] = offset + len(out.text)
        if not (echo or out.text or out.logprobs or out.finished):
            continue
        lp = completion_logprobs(out.logprobs, offset) if out.logprobs is not None else None
        prompt_lps = None
        if scoring is not None and out.prompt_logprobs is not None:  # a choice's first output carries them
            lp, prompt_lps = scoring.legacy(p, out.prompt_logprobs, lp), scoring.vllm_field(out.prompt_logprobs)
        choice = CompletionChoice(index=c, text=echo + out.text, logprobs=lp, finish_reason=out.finish_reason,
                                  prompt_logprobs=prompt_lps)
        yield CompletionResponse(id=id, created=created, model=model, choices=[choice]).model_dump()
    if include_usage:
        usage = _usage(sum(prompt_tokens.values()), sum(completion.values()), sum(cached.values()))
        yield CompletionResponse(id=id, created=created, model=model, choices=[], usage=usage).model_dump()
