"""The request plan, one for every API family: a family-neutral description of a request -> what the engine runs.

Each API family's converter maps its own wire fields, and only those, into a `PlanRequest`:

    params             engine `SamplingParams` of the request's sampling fields, with its structured-output
                       `Constraint` (parsed by `app/chat/structured.py`'s parsers), or none
    constraint_field   the wire field that set that constraint, named in a 400 when it does not compile
    tools              a chat request's tools as OpenAI-shaped functions ({"name", "description", "parameters"})
                       and its tool choice (`ToolsRequest`); None for an API without tools (completions)
    conversations      chat: one list of messages (`app.openai.schemas.ChatMessage`) per prompt
    prompt_ids         completions: the prompts, already token ids (`app/chat/prompts.py` makes them)

`build_plan` then does the same steps in the same order for every family, before anything is queued:

    1. compile the structured constraint (off the event loop; a 400 naming `constraint_field`)
    2. the `ToolPlan` (`app/chat/tools.py`): tool choice checked, its constraint set on the params (a tool
       constraint beside a structured one is a 400), compiled (a 400 naming `tools`)
    3. the prompt token ids: each conversation through the model's chat template with the tools, or the ids given

and answers a `RequestPlan` (params, tool plan, prompts) for the family's route to run and to convert back.
This module's names (`PlanRequest`, `ToolsRequest`, `RequestPlan`, `build_plan`) are the stable entry point
for API families; see docs/app-layout.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.chat import structured
from app.chat.prompts import chat_prompt_ids
from app.chat.tools import NamedChoice, ToolPlan, plan_for
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
class PlanRequest:
    """What a family's converter hands over (see the module docstring). Give `conversations` for a chat
    request or `prompt_ids` for a completion, not both."""

    params: SamplingParams
    constraint_field: str | None = None
    tools: ToolsRequest | None = None
    conversations: Sequence[Sequence[ChatMessage]] = ()
    prompt_ids: Sequence[list[int]] = ()


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
    """The one request plan (module docstring): constraint checked, tools planned, prompts tokenised.
    Raises BadRequestError (the family's error envelope maps it) for anything the request cannot have."""
    params = request.params
    await structured.check(params.constraint, tokenizer, request.constraint_field)
    tool_plan = plan_tools(request.tools, tokenizer, tool_call_parser)
    if tool_plan is not None:
        params = tool_plan.sampling_params(params)
        await structured.check(tool_plan.constraint, tokenizer, "tools")
    prompts = [chat_prompt_ids(tokenizer, messages, tool_plan) for messages in request.conversations]
    return RequestPlan(params, tool_plan, prompts or [list(ids) for ids in request.prompt_ids])
