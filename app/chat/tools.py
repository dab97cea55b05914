"""Tools, whichever API family they come from: the `ToolPlan` and the prompt side.

A request with tools (as OpenAI-shaped functions and a tool choice: `app/chat/plan.py`'s `ToolsRequest`, which each
family's converter fills from its own wire fields) becomes a `ToolPlan`: the tool-call format of the model (`app/chat/tool_parsers.py`, picked
from its chat template or `--tool-call-parser`), the tools as the template receives them, and the grammar
that keeps calls valid (an engine `Constraint` in Lark, the arguments as `%json {schema}`):

| `tool_choice`     | prompt          | constraint                                                  | parsed |
|-------------------|-----------------|-------------------------------------------------------------|--------|
| `none`            | tools           | none                                                        | no     |
| `auto` (default)  | tools           | lazy: free text until the format's trigger, then valid calls | yes    |
| `required`        | tools           | from the first token: one call or more (one if not parallel) | yes    |
| `{"type": "function", "function": {"name"}}` | tools | from the first token: one call of that tool   | yes    |

Tool definitions reach the prompt through the model's own chat template (`apply_chat_template(tools=...)`).
A template that takes no `tools` gets `DEFAULT_TOOL_PROMPT` as (the start of) its system message, in the
format SmolLM2-Instruct was trained on: `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`; its
assistant tool calls are written back in that format and tool results sent as `<tool_response>` user turns.
A template that reads the tools off the system message (Phi-4-mini's `message['tools']`) gets them there as JSON
text, and earlier calls in their turn's content as `<|tool_call|>[...]<|/tool_call|>`.

Reading calls back out of the answer is each family's: `app/openai/tools.py`, `app/llama_stack/tools.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from app.chat.tool_parsers import (
    FORMATS,
    CallStream,
    ToolFormat,
    detect,
    template_takes_tools,
    tools_in_system,
)
from app.errors import BadRequestError
from engine.types import Constraint, SamplingParams

DEFAULT_TOOL_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible \
functions. Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \
If none of the functions can be used, answer the question directly.

You have access to the following tools:
<tools>{tools}</tools>

To call tools, answer with only this, in this format:
<tool_call>[{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}}, \
... (more tool calls as required)]</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools change: the prompt, the constraint, and how the answer is read."""

    fmt: ToolFormat
    functions: list[dict[str, Any]]  # {"name", "description", "parameters"} per tool
    choice: Literal["none", "auto", "required", "function"]
    parallel: bool
    constraint: Constraint | None
    special_trigger: bool = False  # the trigger is one special token: keep special tokens in the text

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def new_stream(self) -> CallStream:
        return CallStream(self.fmt, self.names, None if self.parallel else 1)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tool constraint (and special tokens kept when the format's trigger is one)."""
        if self.constraint is not None and params.constraint is not None:
            raise BadRequestError(
                "tool_choice constrains the answer to tool calls; it cannot be combined with response_format "
                "or another structured output field.", param="tool_choice",
            )
        skip = params.skip_special_tokens and not (self.parses and self.special_trigger)
        if self.constraint is None:
            return replace(params, skip_special_tokens=skip)
        return replace(params, constraint=self.constraint, skip_special_tokens=skip)


@dataclass(frozen=True, slots=True)
class NamedChoice:
    name: str


def plan_for(functions: list[dict[str, Any]], choice: str | NamedChoice | None, parallel: bool, tokenizer: Any,
             parser: str = "auto", param: str = "tool_choice") -> ToolPlan | None:
    """The plan for `functions` ({"name", "description", "parameters"}) and a tool choice (none, auto,
    required, or NamedChoice), whichever API they came from."""
    if not functions:
        if choice not in (None, "none", "auto"):
            raise BadRequestError("tool_choice requires tools.", param=param)
        return None
    _check_unique(functions)
    fmt = FORMATS[parser if parser in FORMATS else detect(getattr(tokenizer, "chat_template", None))]
    special = special_token_id(fmt.trigger, tokenizer) is not None
    if choice is None or choice == "auto":
        constraint = _constraint(fmt, functions, parallel, tokenizer, True)
        return ToolPlan(fmt, functions, "auto", parallel, constraint, special)
    if choice == "none":
        return ToolPlan(fmt, functions, "none", parallel, None, special)
    if choice == "required":
        constraint = _constraint(fmt, functions, parallel, tokenizer, False)
        return ToolPlan(fmt, functions, "required", parallel, constraint, special)
    if not isinstance(choice, NamedChoice):
        raise BadRequestError(f"Unknown tool_choice {choice!r}.", param=param)
    named = [f for f in functions if f["name"] == choice.name]
    if not named:
        raise BadRequestError(
            f"tool_choice names the function {choice.name!r}, which is not among tools "
            f"({', '.join(f['name'] for f in functions)}).", param=param,
        )
    return ToolPlan(fmt, functions, "function", False, _constraint(fmt, named, False, tokenizer, False), special)


def _check_unique(functions: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for i, f in enumerate(functions):
        if f["name"] in seen:
            raise BadRequestError(f"Two tools are named {f['name']!r}.", param=f"tools[{i}].function.name")
        seen.add(f["name"])


def _constraint(fmt: ToolFormat, functions: list[dict[str, Any]], parallel: bool, tokenizer: Any,
                lazy: bool) -> Constraint:
    grammar = fmt.grammar(functions, parallel, lazy=lazy, term=lambda tag: _terminal(tag, tokenizer))
    return Constraint(kind="lark", value=grammar, trigger=(fmt.grammar_trigger or fmt.trigger) if lazy else None)


def _terminal(tag: str, tokenizer: Any) -> str:
    """A tag as a Lark terminal: `<[id]>` when the tokenizer has it as one (added) token, which the grammar
    library never matches against quoted text; else the quoted text."""
    token_id = _token_id(tag, tokenizer)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(tag)


def _token_id(tag: str, tokenizer: Any) -> int | None:
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    token_id = convert(tag) if convert is not None else None
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return token_id if tokenizer.decode([token_id], skip_special_tokens=False) == tag else None


def special_token_id(tag: str, tokenizer: Any) -> int | None:
    """The id of `tag` when it is one special token of `tokenizer` (`[TOOL_CALLS]`, Hermes 3's `<tool_call>`):
    such a token is dropped from text decoded with skip_special_tokens, so the parser would never see it."""
    token_id = _token_id(tag, tokenizer)
    if token_id is None or tokenizer.decode([token_id], skip_special_tokens=True) != "":
        return None
    return token_id


# ---------------------------------------------------------------- prompt


def template_input(conversation: list[dict[str, Any]], tool_plan: ToolPlan | None,
                   template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `apply_chat_template`: as they are for a template that takes tools; on the system
    message for one that reads them there; with the default tool prompt and the calls written as text for one
    that takes none."""
    conversation = [_json_arguments(m) for m in conversation]
    if template and "alphanumeric strings with length 9" in template:  # Mistral's templates refuse other ids
        conversation = [_nine_char_ids(m) for m in conversation]
    if tools_in_system(template):
        return _system_tools(conversation, tool_plan), None
    if template_takes_tools(template):
        tools = [{"type": "function", "function": _described(f, template)} for f in tool_plan.functions] \
            if tool_plan else None
        return conversation, tools
    out = [_plain_message(m) for m in conversation]
    if tool_plan is not None:
        prompt = DEFAULT_TOOL_PROMPT.format(tools=json.dumps(tool_plan.functions))
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": f"{prompt}\n\n{out[0]['content']}".rstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


# Phi-4-mini's model card: the system turn of a conversation with tools, where the request has none
SYSTEM_WITH_TOOLS = "You are a helpful assistant with some tools."


def _system_tools(conversation: list[dict[str, Any]], tool_plan: ToolPlan | None) -> list[dict[str, Any]]:
    """For a template that reads the tools off the system message (Phi-4-mini's): the functions as JSON text on
    it (one is added where the request has none), and earlier calls written as the model writes them,
    `<|tool_call|>[{"name", "arguments"}, ...]<|/tool_call|>` (the template renders role and content only)."""
    out = []
    for message in conversation:
        calls = message.get("tool_calls")
        content = message.get("content") or ""
        if calls:
            content += f"<|tool_call|>{json.dumps(_listed(calls))}<|/tool_call|>"
        out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")} | {"content": content})
    if tool_plan is not None:
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": SYSTEM_WITH_TOOLS})
        out[0] = out[0] | {"tools": json.dumps(tool_plan.functions)}
    return out


def _described(function: dict[str, Any], template: str | None) -> dict[str, Any]:
    """A tool without a description gets an empty one for a template that reads the field unguarded (gpt-oss's,
    Hermes 3's: `"// " + tool.description` fails on an undefined value, so the request would be a 400)."""
    if function.get("description") is not None or ".description" not in (template or ""):
        return function
    return function | {"description": ""}


def _json_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """Assistant tool calls with their arguments as objects (templates write them with `tojson`)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):
                function["arguments"] = json.loads(function["arguments"])
        fixed.append(call | {"function": function})
    return message | {"tool_calls": fixed}


def _nine_char_id(call_id: str) -> str:
    """The same id on the call and on its result, in the 9 alphanumeric characters Mistral's templates take."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _nine_char_ids(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("tool_call_id"):
        message = message | {"tool_call_id": _nine_char_id(message["tool_call_id"])}
    if message.get("tool_calls"):
        calls = [c | {"id": _nine_char_id(c["id"])} if c.get("id") else c for c in message["tool_calls"]]
        message = message | {"tool_calls": calls}
    return message


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A tool-call turn or tool result as text, for templates that only render role and content."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    text = (message.get("content") or "") + f"<tool_call>{json.dumps(_listed(calls))}</tool_call>"
    return {"role": "assistant", "content": text}


def _listed(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as the models that write them as text write them: `{"name", "arguments"}`."""
    return [{"name": c["function"].get("name"), "arguments": c["function"].get("arguments", {})} for c in calls]
