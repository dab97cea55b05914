"""Tool-call formats: how a model writes a call, the grammar that keeps a call valid, and the parser that
reads calls back out of the generated text (whole answers and streams alike).

| parser        | the model writes                                                        | picked when the template |
|---------------|-------------------------------------------------------------------------|--------------------------|
| `hermes`      | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call | writes `<tool_call>`; or takes `tools` |
| `llama3_json` | `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or not), `;` between calls | writes `<|python_tag|>`, or `"parameters"` in a Llama 3 header format (3.2) |
| `mistral`     | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral Nemo)   | writes `[TOOL_CALLS]`    |
| `mistral_args`| `[TOOL_CALLS]name[ARGS]{...}` per call (Mistral Small 3.2, Ministral 3)  | writes `[ARGS]`          |
| `granite`     | `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (Granite 3.x)   | writes `<|tool_call|>`   |
| `phi4_mini`   | `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>` (Phi-4-mini) | writes `<|/tool|>` |
| `harmony`     | `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (gpt-oss; one call a turn) | writes `<|channel|>` and `<|message|>` |
| `smollm2`     | `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`       | takes no `tools` (default prompt) |

`smollm2` is the format SmolLM2-Instruct was trained on (its model card's tool prompt), and the format of the
default system prompt Peregrine writes for templates without tool support (`app/chat/tools.py`).

One parser (`CallStream`) serves every format: text is content until the format's trigger (`<tool_call>`,
`[TOOL_CALLS]`, ...); from there every top-level JSON object is a call `{"name", "arguments" | "parameters"}`.
Fed text deltas, it returns content deltas and OpenAI tool-call deltas: the name first (with id and type and
empty arguments), then argument fragments as they are generated. A whole answer is one big delta.
`harmony` calls reach it already in the Hermes form: `app/chat/harmony.py` rewrites them in the reasoning layer,
which runs first; its grammar constrains the harmony text the model writes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from app.chat import harmony
from app.chat.harmony import is_harmony
from engine.core.stopping import partial_stop_len


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One model family's way of writing tool calls."""

    name: str
    trigger: str  # the text that opens the calls (the lazy grammar's trigger)
    args_key: Literal["arguments", "parameters"] = "arguments"
    trigger_in_call: bool = False  # the trigger is the start of the call itself (llama3_json's `{"name":`)
    args_tag: str | None = None  # calls written `name<args_tag>{...}` rather than as JSON objects (mistral_args)
    grammar_trigger: str | None = None  # the lazy grammar's trigger where the model writes another form (harmony)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, *, lazy: bool,
                term: Callable[[str], str] = json.dumps) -> str:
        """Lark source of a valid call (or calls). `lazy`: the grammar of what follows the trigger (the engine
        feeds the matcher the text after it); else from the first token, trigger included. `term`: a tag as a
        Lark terminal (its text quoted, or `<[id]>` where the tokenizer has it as one token)."""
        if self.name == "harmony":
            return _harmony(tools, lazy, term)
        rules = _call_rules(tools, self.args_key)
        if self.args_tag is not None:
            rules += _tagged_call_rule(tools, term(self.args_tag))
        if self.trigger_in_call:  # llama3_json: the trigger is the first call's own opening characters
            first = "call_rest" if lazy else "call"
            return f"start: {_BODIES[self.name](first, parallel, term)}\n{rules}"
        body = _BODIES[self.name]("call", parallel, term)
        return f"start: {body if lazy else f'{term(self.trigger)} {body}'}\n{rules}"


Term = Callable[[str], str]


def _hermes(call: str, parallel: bool, term: Term) -> str:
    open_, close = term("<tool_call>"), term("</tool_call>")
    more = f' ("\\n" {open_} "\\n" call "\\n" {close})*' if parallel else ""
    return f'"\\n" {call} "\\n" {close}{more}'


def _smollm2(call: str, parallel: bool, term: Term) -> str:
    more = ' (", " call)*' if parallel else ""
    return f'"[" {call}{more} "]" {term("</tool_call>")}'


def _mistral(call: str, parallel: bool, term: Term) -> str:
    more = ' (", " call)*' if parallel else ""
    return f'"[" {call}{more} "]"'


def _phi4_mini(call: str, parallel: bool, term: Term) -> str:
    return f"{_mistral(call, parallel, term)} {term('<|/tool_call|>')}"


def _mistral_args(call: str, parallel: bool, term: Term) -> str:
    more = f' ({term("[TOOL_CALLS]")} tagged_call)*' if parallel else ""
    return f"tagged_call{more}"


def _llama3(first: str, parallel: bool, term: Term) -> str:
    more = ' ("; " call)*' if parallel else ""
    return f"{first}{more}"


def _harmony(tools: list[dict[str, Any]], lazy: bool, term: Term) -> str:
    """One harmony call: from the first token `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
    and the arguments; lazy, what follows `to=functions.` (the recipient may stand in the role header, then the
    channel follows the name). The arguments end it: the model's `<|call|>` is a stop token."""
    msg, constrain, channel = term(harmony.MESSAGE), term(harmony.CONSTRAIN), term(harmony.CHANNEL)
    kind = f'(" " {constrain} "json" | " json")'
    alts = " | ".join(f"({_lark_str(tool['name'])} head args_{i})" for i, tool in enumerate(tools))
    if lazy:
        start, head = "harmony_call", f'({kind} | {channel} "commentary" {kind}?)? {msg}'
    else:
        start, head = f'{channel} "commentary to=functions." harmony_call', f'" " {constrain} "json" {msg}'
    return f"start: {start}\nharmony_call: {alts}\nhead: {head}\n" + _call_rules(tools, "arguments")


_BODIES = {"hermes": _hermes, "smollm2": _smollm2, "mistral": _mistral, "llama3_json": _llama3,
           "mistral_args": _mistral_args, "granite": _mistral, "phi4_mini": _phi4_mini}

FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>"),
    "smollm2": ToolFormat("smollm2", "<tool_call>"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]"),
    "mistral_args": ToolFormat("mistral_args", "[TOOL_CALLS]", args_tag="[ARGS]"),
    "granite": ToolFormat("granite", "<|tool_call|>"),
    "phi4_mini": ToolFormat("phi4_mini", "<|tool_call|>"),
    "harmony": ToolFormat("harmony", "<tool_call>", grammar_trigger="to=functions."),
    "llama3_json": ToolFormat("llama3_json", '{"name": ', args_key="parameters", trigger_in_call=True),
}

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _call_rules(tools: list[dict[str, Any]], args_key: str) -> str:
    """`call`: `{"name": "<one of the tools>", "<args_key>": <JSON valid for that tool's schema>}`;
    `call_rest`: the same after its opening `{"name": ` (the llama3_json trigger)."""
    alts, rest, lines = [], [], []
    for i, tool in enumerate(tools):
        name = _lark_str(json.dumps(tool["name"]))
        key = _lark_str(f', "{args_key}": ')
        lines.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool.get('parameters')))}")
        rest.append(f'{name} {key} args_{i} "}}"')
        alts.append(f'"{{\\"name\\": " {rest[-1]}')
    lines.insert(0, "call: " + " | ".join(f"({a})" for a in alts))
    lines.insert(1, "call_rest: " + " | ".join(f"({r})" for r in rest))
    return "\n".join(lines) + "\n"


def _tagged_call_rule(tools: list[dict[str, Any]], tag: str) -> str:
    """`tagged_call`: `<name><tag><arguments JSON>` (mistral_args), reusing `call_rules`' `args_<i>`."""
    alts = [f"({_lark_str(tool['name'])} {tag} args_{i})" for i, tool in enumerate(tools)]
    return "tagged_call: " + " | ".join(alts) + "\n"


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The tool's parameters schema, written compactly; an object with declared properties admits no others
    (a call is meant for the declared parameters; small models otherwise invent keys without end)."""
    schema = dict(parameters) if parameters else {"type": "object", "properties": {}}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    schema["x-guidance"] = {**COMPACT_JSON, **schema.get("x-guidance", {})}
    return schema


def _lark_str(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text)


def detect(template: str | None) -> str:
    """The parser for a model, from the text of its chat template (see the module table): the markers the
    template writes in assistant turns are the ones the model was trained to generate."""
    template = template or ""
    if is_harmony(template):
        return "harmony"
    if "[TOOL_CALLS]" in template:
        return "mistral_args" if "[ARGS]" in template else "mistral"
    if "<|/tool|>" in template:  # Phi-4-mini: tools in the system turn, calls in <|tool_call|>...<|/tool_call|>
        return "phi4_mini"
    if "<|tool_call|>" in template:
        return "granite"
    if "<|python_tag|>" in template:
        return "llama3_json"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template and "<|start_header_id|>" in template:  # Llama 3.2: JSON calls, no python_tag
        return "llama3_json"
    return "hermes" if template_takes_tools(template) else "smollm2"


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders the `tools` it is given (else they would vanish silently)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


_SYSTEM_TOOLS = re.compile(r"""message\[\s*['"]tools['"]\s*\]|message\.tools\b""")


def tools_in_system(template: str | None) -> bool:
    """Whether a chat template reads the tools off the system message (`message['tools']`, JSON text), not from
    the `tools` variable: Phi-4-mini's, which writes them between `<|tool|>` and `<|/tool|>`."""
    return _SYSTEM_TOOLS.search(template or "") is not None


# ---------------------------------------------------------------- parsing


@dataclass(slots=True)
class CallDelta:
    """One OpenAI tool-call delta: the first of a call carries id and name (and empty arguments)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(slots=True)
class _Open:
    """The call being generated: its text so far and how much of its arguments went out."""

    text: str = ""
    id: str = ""  # set once the name went out
    args_at: int = -1  # where the arguments start in `text`
    sent: int = 0  # argument characters sent
    rejected: bool = False  # names no tool: not a call, never streamed
    args_end: int = -1  # where the arguments end in `text`, once they have (keys may follow: Mistral's "id")


@dataclass(slots=True)
class CallStream:
    """Splits one choice's generated text into content and tool calls, incrementally.

    `names`: the tools a call may name (an object naming another is not a call). `max_calls`: 1 for
    `parallel_tool_calls: false` (later calls are dropped)."""

    fmt: ToolFormat
    names: frozenset[str] | None = None
    max_calls: int | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""
    _in_calls: bool = False
    _open: _Open | None = None
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _name: str = ""  # mistral_args: the call's name, read up to its `[ARGS]`

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """(content delta, tool-call deltas) for this much more text; `final` on the last piece."""
        self._buffer += text
        content = "" if self._in_calls else self._content(final)
        deltas: list[CallDelta] = []
        if self._in_calls:
            self._scan(deltas)
        return content, _merged(deltas)

    @property
    def in_calls(self) -> bool:
        return self._in_calls

    def _content(self, final: bool) -> str:
        at = self._buffer.find(self.fmt.trigger)
        if at < 0:
            keep = 0 if final else partial_stop_len(self._buffer, (self.fmt.trigger,))
            cut = len(self._buffer) - keep
            out, self._buffer = self._buffer[:cut], self._buffer[cut:]
            return out
        out = self._buffer[:at]
        self._buffer = self._buffer[at if self.fmt.trigger_in_call else at + len(self.fmt.trigger):]
        self._in_calls = True
        return out

    def _scan(self, deltas: list[CallDelta]) -> None:
        """Walk the buffered call text: outside objects skip to the next `{`; inside, track depth."""
        for ch in self._buffer:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                break
            if self._open is None:
                if self.fmt.args_tag is not None:
                    self._tagged_head(ch)
                    continue
                if ch != "{":
                    continue
                self._open, self._depth, self._in_string = _Open(), 0, False
            self._open.text += ch
            self._track(ch)
            if self._depth == 1 and ch in "}]" and not self._in_string and self._open.args_end < 0:
                self._open.args_end = len(self._open.text)  # back in the call object: the arguments are whole
            if self.fmt.args_tag is not None and self._depth == 1 and ch in "}]" and not self._in_string:
                self._open.text += "}"  # the arguments closed: so does the call object `_tagged_head` opened
                self._depth = 0
            if self._depth == 0:
                self._close(deltas)
            else:
                self._progress(deltas)
        self._buffer = ""

    def _tagged_head(self, ch: str) -> None:
        """mistral_args: read `name[ARGS]` (later calls behind their own `[TOOL_CALLS]`), then go on as if the
        model had written `{"name": "name", "arguments": ` so the JSON path streams the arguments."""
        assert self.fmt.args_tag is not None
        self._name += ch
        if not self._name.endswith(self.fmt.args_tag):
            return
        name = self._name[: -len(self.fmt.args_tag)].replace(self.fmt.trigger, "").split("[CALL_ID]")[0].strip()
        self._name = ""
        self._open, self._depth, self._in_string = _Open(), 1, False
        self._open.text = f'{{"name": {json.dumps(name)}, "arguments": '

    def _track(self, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def _progress(self, deltas: list[CallDelta]) -> None:
        """Send the name once known, then the arguments' new characters (trailing whitespace held back)."""
        call = self._open
        assert call is not None
        if call.rejected:
            return
        if call.args_at < 0:
            match = _HEAD.match(call.text)
            if match is None or match.end() == len(call.text):  # the arguments' first character is not here yet
                return
            name = json.loads(f'"{match.group(1)}"')
            if self.names is not None and name not in self.names:
                call.rejected = True
                return
            call.args_at, call.id = match.end(), new_call_id()
            deltas.append(CallDelta(len(self.calls), call.id, name, ""))
        end = call.args_end if call.args_end >= 0 else len(call.text)
        new = call.text[call.args_at + call.sent:end].rstrip()
        if call.id and new:
            call.sent += len(new)
            deltas.append(CallDelta(len(self.calls), arguments=new))

    def _close(self, deltas: list[CallDelta]) -> None:
        """A call object is complete: finish its deltas (or send it whole) and record it."""
        call, self._open = self._open, None
        assert call is not None
        try:
            obj = json.loads(call.text)
        except ValueError:
            obj = None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            return  # not a call (free text after the trigger)
        index = len(self.calls)
        if call.id:
            end = call.args_end if call.args_end >= 0 else len(call.text) - 1  # without the call's closing brace
            raw = call.text[call.args_at:end].rstrip()
            if len(raw) > call.sent:
                deltas.append(CallDelta(index, arguments=raw[call.sent:]))
            self.calls.append(ParsedCall(call.id, name, raw))
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args)
        call_id = new_call_id()
        deltas.append(CallDelta(index, call_id, name, text))
        self.calls.append(ParsedCall(call_id, name, text))


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive argument fragments of one call as one delta."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and d.id is None and out[-1].id is None and out[-1].index == d.index:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out


def parse(fmt: ToolFormat, text: str, names: frozenset[str] | None = None,
          max_calls: int | None = None) -> tuple[str, list[ParsedCall]]:
    """A whole answer: (content before the calls, the calls)."""
    stream = CallStream(fmt, names, max_calls)
    content, _ = stream.feed(text, final=True)
    return content, stream.calls
