"""The request plan, one for every API family: a family-neutral description of a request -> what the engine runs.

Each API family's converter maps its own wire fields, and only those, into a `PlanRequest`:

    params             engine `SamplingParams` of the request's sampling fields, with its structured-output
                       `Constraint` (parsed by `app/chat/structured.py`'s parsers), or none
    constraint_field   the wire field that set that constraint, named in a 400 when it does not compile
    tools              a chat request's tools as OpenAI-shaped functions ({"name", "description", "parameters"})
                       and its tool choice (`ToolsRequest`); None for an API without tools (completions)
    conversations      chat: one list of messages (`app.openai.schemas.ChatMessage`) per prompt
    prompt_ids         completions: the prompts, already token ids (`app/chat/prompts.py` makes them)
    options            what one family's API means differently (`Options`: Anthropic's prefill turn, its
                       `max_tokens` as a cap, calls never refused for a schema keyword; counting without generating)

`build_plan` then does the same steps in the same order for every family, before anything is queued:

    1. the `ToolPlan` (`app/chat/tools.py`): tool choice checked, its constraint set on the params (a tool
       constraint beside a structured one is a 400)
    2. the prompt token ids: each conversation through the model's chat template with the tools, or the ids given;
       with `Options.cap_to_context`, `max_tokens` cut to the room the prompt leaves (none left: a 400)
    3. the structured and tool constraints compiled (off the event loop; a 400 naming `constraint_field` or
       `tools`), last because compiling many tools' grammar takes a while; skipped when only counting

and answers a `RequestPlan` (params, tool plan, prompts) for the family's route to run and to convert back.
This module's names (`PlanRequest`, `ToolsRequest`, `RequestPlan`, `build_plan`) are the stable entry point
for API families; see docs/app-layout.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from app.chat import harmony, structured
from app.chat.prompts import chat_prompt_ids, chat_prompt_text
from app.chat.tools import NamedChoice, ToolPlan, plan_for, special_token_id
from app.errors import BadRequestError
from app.openai.schemas import ChatMessage
from engine.types import SamplingParams

ToolChoice = Literal["none", "auto", "required"] | NamedChoice | None


@dataclass(frozen=True, slots=True)
class ToolsRequest:
    """A request's tools, whichever API they came from. `functions` may be empty (then a tool choice other
    than none / auto is a 400); `choice` None means the API's default (auto)."""

    functions: list[dict[str, Any]]
    choice: ToolChoice = None
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class Options:
    """A family's own meanings (all off: OpenAI's). `continue_final_message`: a last assistant turn of text is
    continued, not answered (Anthropic's prefill). `cap_to_context`: the model's context length when `max_tokens`
    is only a cap (Anthropic's clients send 32000). `lenient_tools`: tool calls are constrained by the schema
    keywords the grammar library implements, the others skipped (Claude Code's tools use `propertyNames`; the
    prompt keeps the schemas as sent). `count_only`: the prompt is wanted, not an answer (nothing compiled)."""

    continue_final_message: bool = False
    cap_to_context: int | None = None
    lenient_tools: bool = False
    count_only: bool = False


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What a family's converter hands over (see the module docstring). Give `conversations` for a chat
    request or `prompt_ids` for a completion, not both."""

    params: SamplingParams
    constraint_field: str | None = None
    tools: ToolsRequest | None = None
    conversations: Sequence[Sequence[ChatMessage]] = ()
    prompt_ids: Sequence[list[int]] = ()
    options: Options = Options()
    template_kwargs: Mapping[str, Any] | None = None  # chat: variables for the chat template (chat_template_kwargs)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the engine runs: the final params (tool constraint included), the tool plan (None without
    tools) and one prompt of token ids per conversation or prompt."""

    params: SamplingParams
    tool_plan: ToolPlan | None
    prompts: list[list[int]]

    @property
    def parses_tools(self) -> bool:
        """The answer's text is read for tool calls (tools given, tool choice not none)."""
        return self.tool_plan is not None and self.tool_plan.parses


def plan_tools(tools: ToolsRequest | None, tokenizer: Any, parser: str = "auto") -> ToolPlan | None:
    """The ToolPlan of `tools` (None without tools); a 400 for a tool choice that cannot be honoured."""
    if tools is None:
        return None
    return plan_for(tools.functions, tools.choice, tools.parallel, tokenizer, parser)


async def build_plan(tokenizer: Any, request: PlanRequest, tool_call_parser: str = "auto") -> RequestPlan:
    """The one request plan (module docstring): tools planned, prompts tokenised, constraints checked.
    Raises BadRequestError (the family's error envelope maps it) for anything the request cannot have."""
    options, params = request.options, request.params
    tool_plan = plan_tools(request.tools, tokenizer, tool_call_parser)
    if tool_plan is not None:
        params = tool_plan.sampling_params(params)
    if request.conversations and harmony.is_harmony(getattr(tokenizer, "chat_template", None)):
        params = _harmony(params, tokenizer)
    prompts = [_prompt_ids(tokenizer, messages, tool_plan, options.continue_final_message, request.template_kwargs)
               for messages in request.conversations] or [list(ids) for ids in request.prompt_ids]
    if options.count_only:
        return RequestPlan(params, tool_plan, prompts)
    if options.cap_to_context is not None:
        params = _fit(params, max(map(len, prompts)), options.cap_to_context)
    await structured.check(request.params.constraint, tokenizer, request.constraint_field)
    if tool_plan is not None:
        if options.lenient_tools:
            tool_plan = _lenient(tool_plan, request.tools, tokenizer, tool_call_parser)
            params = replace(params, constraint=tool_plan.constraint or params.constraint)
        await structured.check(tool_plan.constraint, tokenizer, "tools")
    return RequestPlan(params, tool_plan, prompts)


def _prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage], tool_plan: ToolPlan | None,
                continue_final: bool, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The rendered conversation; with `continue_final`, a last assistant turn of text is continued."""
    last = messages[-1] if messages else None
    if not continue_final or last is None or last.role != "assistant" or last.tool_calls:
        return chat_prompt_ids(tokenizer, messages, tool_plan, template_kwargs)
    text = chat_prompt_text(tokenizer, messages, add_generation_prompt=False, continue_final_message=True,
                            tool_plan=tool_plan, template_kwargs=template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _harmony(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """A chat turn of a harmony model (gpt-oss): its channel markers are special tokens, kept in the text for the
    harmony splitter (`app/chat/harmony.py`), and its turn-ending tokens stop it whatever its configuration says."""
    ids = [i for tag in harmony.STOP_TOKENS if (i := special_token_id(tag, tokenizer)) is not None]
    stops = params.stop_token_ids + tuple(i for i in ids if i not in params.stop_token_ids)
    return replace(params, skip_special_tokens=False, stop_token_ids=stops)


def _fit(params: SamplingParams, prompt_len: int, context: int) -> SamplingParams:
    """`max_tokens` as a cap: at most what the context has room for. A prompt that leaves no room is a 400."""
    room = context - prompt_len
    if room < 1:
        raise BadRequestError(
            f"The prompt ({prompt_len} tokens, tools and system included) does not fit this model's context of "
            f"{context} tokens.", param="messages", code="context_length_exceeded",
        )
    return replace(params, max_tokens=min(params.max_tokens or room, room))


LENIENT = {"x-guidance": {"lenient": True}}  # the grammar library skips JSON Schema keywords it does not implement


def _lenient(plan: ToolPlan, tools: ToolsRequest | None, tokenizer: Any, parser: str) -> ToolPlan:
    """The plan with a grammar that skips the schema keywords the grammar library lacks (`Options.lenient_tools`)."""
    if plan.constraint is None or tools is None:
        return plan
    functions = [{**f, "parameters": {**(f.get("parameters") or {}), **LENIENT}} for f in tools.functions]
    lenient = plan_tools(replace(tools, functions=functions), tokenizer, parser)
    return replace(plan, constraint=lenient.constraint if lenient is not None else plan.constraint)
