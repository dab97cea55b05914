"""app/chat/tools.py and app/chat/tool_parsers.py: tool calls parsed from each model family's format (whole and streamed in
any chunking), the grammars that keep calls valid (checked directly with llguidance), tool_choice checks, and
the prompt each kind of chat template gets."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import llguidance
import llguidance.hf
import pytest

from app.chat.plan import plan_tools
from app.chat.tool_parsers import FORMATS, CallStream, detect, parse
from app.chat.tools import DEFAULT_TOOL_PROMPT, ToolPlan, template_input
from app.errors import BadRequestError
from app.openai.convert import tools_request
from app.openai.schemas import ChatCompletionRequest
from app.openai.tools import split_chunks
from tests.support import NoToolsTokenizer


def plan(req: ChatCompletionRequest, tokenizer: Any, parser: str = "auto") -> ToolPlan | None:
    """An OpenAI request's ToolPlan, as the shared request plan makes it (app/chat/plan.py)."""
    return plan_tools(tools_request(req), tokenizer, parser)

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "integer"}},
                                           "required": ["tz"]}}
NAMES = frozenset({"get_weather", "get_time"})

ANSWERS = {  # format -> (model output, content, [(name, arguments)])
    "hermes": (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": 2}}\n</tool_call>',
        "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": 2})],
    ),
    "smollm2": (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\" {x}"}}, '
        '{"name": "get_time", "arguments": {"tz": -1}}]</tool_call>',
        "", [("get_weather", {"city": 'Paris "centre" {x}'}), ("get_time", {"tz": -1})],
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]',
        "", [("get_weather", {"city": "Oslo", "unit": "c"})],
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {"tz": 1}}',
        "", [("get_weather", {"city": "Rome"}), ("get_time", {"tz": 1})],
    ),
    "mistral_args": (  # Mistral Small 3.2 / Ministral 3: each call behind its own [TOOL_CALLS]
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo {x}", "unit": "c"}[TOOL_CALLS]get_time[ARGS]{"tz": 2}',
        "Let me check.", [("get_weather", {"city": "Oslo {x}", "unit": "c"}), ("get_time", {"tz": 2})],
    ),
    "granite": (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Lima"}}, '
        '{"name": "get_time", "arguments": {"tz": -5}}]',
        "", [("get_weather", {"city": "Lima"}), ("get_time", {"tz": -5})],
    ),
    "phi4_mini": (  # Phi-4-mini: Granite's list, closed by <|/tool_call|>
        'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Lima"}}, '
        '{"name": "get_time", "arguments": {"tz": -5}}]<|/tool_call|>',
        "Checking.", [("get_weather", {"city": "Lima"}), ("get_time", {"tz": -5})],
    ),
}


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_parse_whole_answer(fmt: str) -> None:
    text, content, expected = ANSWERS[fmt]
    got_content, calls = parse(FORMATS[fmt], text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
@pytest.mark.parametrize("seed", range(5))
def test_stream_deltas_assemble_to_the_whole_answer(fmt: str, seed: int) -> None:
    """Any chunking: content never leaks call text; per call one delta with id, name and "" arguments first,
    then fragments whose concatenation is the call's arguments."""
    text, content, expected = ANSWERS[fmt]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 30))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = CallStream(FORMATS[fmt], NAMES)
    got_content, calls = "", {}
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        got_content += c
        for d in deltas:
            if d.index not in calls:
                assert d.id and d.id.startswith("call_") and d.name and d.arguments in ("", d.arguments)
                calls[d.index] = [d.name, d.arguments]
            else:
                assert d.id is None and d.name is None
                calls[d.index][1] += d.arguments
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in calls.values()] == expected
    assert [c.arguments for c in stream.calls] == [a for _, a in calls.values()]


def test_streamed_call_sends_the_name_before_the_arguments_end() -> None:
    stream = CallStream(FORMATS["hermes"], NAMES)
    _, deltas = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", ""), (None, '{"ci')]


def test_text_that_is_not_a_call() -> None:
    fmt = FORMATS["hermes"]
    assert parse(fmt, "No tools needed: 2 + 2 = 4.", NAMES) == ("No tools needed: 2 + 2 = 4.", [])
    content, calls = parse(fmt, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', NAMES)
    assert calls == [] and content == ""
    _, calls = parse(FORMATS["llama3_json"], '{"name": "Bob", "parameters": {}}', NAMES)
    assert calls == []
    assert parse(fmt, "a <tool_ca", NAMES) == ("a <tool_ca", [])  # a partial trigger at the end is content


def test_parallel_false_keeps_the_first_call() -> None:
    text = ANSWERS["hermes"][0]
    _, calls = parse(FORMATS["hermes"], text, NAMES, max_calls=1)
    assert [c.name for c in calls] == ["get_weather"]


def test_detect_from_template() -> None:
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}") == "mistral_args"
    assert detect("{{ '<|tool_call|>' }}") == "granite"
    assert detect("{{ '<|tool|>' + message['tools'] + '<|/tool|>' }}") == "phi4_mini"
    assert detect("<|start_header_id|>{{ '\"parameters\": ' }}{{ tools }}") == "llama3_json"
    assert detect("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect("{% for tool in tools %}{{ tool }}{% endfor %}") == "hermes"
    assert detect("{{ message['content'] }}") == "smollm2"
    assert detect(None) == "smollm2"


# ---------------------------------------------------------------- grammars, checked with llguidance


@pytest.fixture(scope="module")
def ll(byte_level_tokenizer: Any) -> tuple[Any, llguidance.LLTokenizer]:
    return byte_level_tokenizer, llguidance.hf.from_tokenizer(byte_level_tokenizer)


def accepts(ll: tuple[Any, llguidance.LLTokenizer], lark: str, text: str) -> bool:
    """Whether `text` is a complete sentence of the grammar (every token allowed, then EOS allowed)."""
    tokenizer, lltok = ll
    grammar = llguidance.grammar_from("lark", lark)
    assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""
    matcher = llguidance.LLMatcher(lltok, grammar)
    ids = lltok.tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def request(**fields: Any) -> ChatCompletionRequest:
    base = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]}
    return ChatCompletionRequest.model_validate(base | fields)


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_required_grammar_accepts_valid_calls_only(ll: Any, fmt: str) -> None:
    f = FORMATS[fmt]
    lark = f.grammar([WEATHER, TIME], True, lazy=False)
    text = re.sub(r"^(Let me check\.|Checking\.)", "", ANSWERS[fmt][0])
    assert accepts(ll, lark, text)
    assert not accepts(ll, lark, re.sub(r"\"city\": \"(?:[^\"\\]|\\.)*\"", "\"city\": 3", text))  # wrong type
    assert not accepts(ll, lark, text.replace("get_weather", "get_wether"))
    assert not accepts(ll, lark, text.replace('"city"', '"town"'))  # declared properties only
    single = f.grammar([WEATHER, TIME], False, lazy=False)
    assert accepts(ll, single, text) == (len(ANSWERS[fmt][2]) == 1)


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_lazy_grammar_covers_the_text_after_the_trigger(ll: Any, fmt: str) -> None:
    f = FORMATS[fmt]
    text = ANSWERS[fmt][0]
    after = text[text.index(f.trigger) + len(f.trigger):]
    lark = f.grammar([WEATHER, TIME], True, lazy=True)
    assert accepts(ll, lark, after)


def test_plan_required_named_auto_none() -> None:
    tok = NoToolsTokenizer()
    auto = plan(request(), tok)
    assert auto is not None and auto.choice == "auto" and auto.constraint.trigger == "<tool_call>"
    assert auto.constraint.kind == "lark" and "args_1: %json" in auto.constraint.value
    required = plan(request(tool_choice="required", parallel_tool_calls=False), tok)
    assert required.constraint.trigger is None and required.constraint.value.startswith('start: "<tool_call>"')
    named = plan(request(tool_choice={"type": "function", "function": {"name": "get_time"}}), tok)
    assert "get_weather" not in named.constraint.value and "get_time" in named.constraint.value
    assert named.functions == [WEATHER, TIME] and not named.parallel  # all tools stay in the prompt
    none = plan(request(tool_choice="none"), tok)
    assert none.constraint is None and not none.parses
    assert plan(request(tools=None), tok) is None
    assert plan(request(), tok, "mistral").fmt.name == "mistral"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": WEATHER}] * 2}, "tools[1].function.name"),
])
def test_plan_refuses_what_it_cannot_honour(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequestError) as err:
        plan(request(**fields), NoToolsTokenizer())
    assert err.value.param == param


@pytest.mark.parametrize("body", [
    {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
    {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"tool_choice": "sometimes"},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function"}]}]},
])
def test_schema_refuses_unservable_tools(body: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        request(**body)


# ---------------------------------------------------------------- prompt rendering


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def test_template_with_tools_gets_them_and_object_arguments() -> None:
    p = plan(request(), NoToolsTokenizer())
    messages, tools = template_input(HISTORY, p, "{% for t in tools %}{% endfor %}")
    assert tools == [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == HISTORY[2]


def test_template_without_tools_gets_the_default_prompt_and_text_calls() -> None:
    p = plan(request(), NoToolsTokenizer())
    messages, tools = template_input(HISTORY, p, "{{ messages }}")
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(DEFAULT_TOOL_PROMPT[:40])
    assert json.dumps([WEATHER, TIME]) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}


# Phi-4-mini's own format, written here as its model card gives it: the tools come on the system message
PHI4_MINI_OWN = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
                 "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
                 "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
                 "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|assistant|>' }}{% endif %}")


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_template_reading_tools_off_the_system_message_gets_them_there(system: str | None) -> None:
    """Phi-4-mini's template ignores the `tools` variable: the functions go on the system message as JSON text
    (one is added where the request has none), earlier calls as the model writes them."""
    from jinja2 import Template

    p = plan(request(), NoToolsTokenizer())
    history = ([{"role": "system", "content": system}] if system else []) + HISTORY
    messages, tools = template_input(history, p, PHI4_MINI_OWN)
    assert tools is None
    text = Template(PHI4_MINI_OWN).render(messages=messages, add_generation_prompt=True)
    calls = json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    assert text == (f"<|system|>{system or 'You are a helpful assistant with some tools.'}"
                    f"<|tool|>{json.dumps([WEATHER, TIME])}<|/tool|><|end|><|user|>{HISTORY[0]['content']}<|end|>"
                    f"<|assistant|><|tool_call|>{calls}<|/tool_call|><|end|><|tool|>21 C<|end|><|assistant|>")
    without, _ = template_input(HISTORY, None, PHI4_MINI_OWN)  # no tools: no system turn is added
    assert [m["role"] for m in without] == ["user", "assistant", "tool"] and "tools" not in without[0]


def test_chatml_template_renders_a_tool_history() -> None:
    """The ChatML-style template (SmolLM2's shape) renders the whole round trip as text."""
    from jinja2 import Template

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    messages, _ = template_input(HISTORY, plan(request(), NoToolsTokenizer()), template)
    text = Template(template).render(messages=messages)
    assert "<tool_call>[" in text and "<tool_response>\n21 C" in text and "<tools>[" in text


# ---------------------------------------------------------------- stream chunks


def test_split_chunks_turns_content_into_tool_call_deltas() -> None:
    text = ANSWERS["hermes"][0]

    async def events():
        yield {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        for i in range(0, len(text), 7):
            last = i + 7 >= len(text)
            yield {"choices": [{"index": 0, "delta": {"content": text[i:i + 7]},
                                "finish_reason": "stop" if last else None}]}

    async def collect() -> list[dict[str, Any]]:
        p = plan(request(), NoToolsTokenizer(), "hermes")
        return [e async for e in split_chunks(events(), p.new_stream)]

    out = asyncio.run(collect())
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [tc for e in out for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert deltas[0]["type"] == "function" and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert set(deltas[1]) == {"index", "function"} and set(deltas[1]["function"]) == {"arguments"}
    content = "".join(c["delta"].get("content", "") for e in out for c in e["choices"])
    assert content == "Let me check."


# ---------------------------------------------------------------- through apply_chat_template

QWEN_LIKE = (  # the tool parts of Qwen2.5's template, shortened
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_and_history_render_through_the_models_template() -> None:
    from app.chat.prompts import chat_prompt_text
    from app.openai.schemas import ChatMessage
    from tests.support import build_byte_level_tokenizer

    tokenizer = build_byte_level_tokenizer()
    tokenizer.chat_template = QWEN_LIKE
    p = plan(request(), tokenizer)
    assert p.fmt.name == "hermes"  # the template writes <tool_call>
    text = chat_prompt_text(tokenizer, [ChatMessage.model_validate(m) for m in HISTORY], tool_plan=p)
    assert json.dumps({"type": "function", "function": WEATHER}) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_default_tool_prompt_through_a_template_without_tools() -> None:
    from app.chat.prompts import chat_prompt_text
    from app.openai.schemas import ChatMessage
    from tests.support import build_byte_level_tokenizer

    tokenizer = build_byte_level_tokenizer()  # its test template renders role and content only
    p = plan(request(), tokenizer)
    assert p.fmt.name == "smollm2"
    text = chat_prompt_text(tokenizer, [ChatMessage.model_validate(m) for m in HISTORY], tool_plan=p)
    assert "<tools>" in text and '"name": "get_time"' in text
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' in text
    no_tools = chat_prompt_text(tokenizer, [ChatMessage.model_validate(m) for m in HISTORY])
    assert "<tools>" not in no_tools and "<tool_response>\n21 C" in no_tools  # a history renders without tools


@pytest.mark.parametrize("special", [True, False])
def test_a_trigger_that_is_a_special_token_is_kept_in_the_text(special: bool) -> None:
    """Hermes 3 / Mistral: `<tool_call>` / `[TOOL_CALLS]` are special tokens, which skip_special_tokens would drop
    from the text the parser reads. Special or not (Qwen's), a tag the tokenizer has as one token is written in
    the grammar as that token (the grammar library never matches added tokens against quoted text)."""
    from transformers import AddedToken

    from engine.types import SamplingParams
    from tests.support import build_byte_level_tokenizer

    tokenizer = build_byte_level_tokenizer()
    tokenizer.add_tokens([AddedToken("<tool_call>", special=special)], special_tokens=special)
    token_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    p = plan(request(tool_choice="required"), tokenizer, "hermes")
    assert p.special_trigger is special
    assert p.sampling_params(SamplingParams()).skip_special_tokens is not special
    assert p.constraint.value.startswith(f"start: <[{token_id}]>")  # one token either way
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.grammar_from("lark", p.constraint.value)
    assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""
    matcher = llguidance.LLMatcher(lltok, grammar)
    text = '\n{"name": "get_time", "arguments": {"tz": 3}}\n</tool_call>'
    ids = [token_id, *lltok.tokenize_str(text)]
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_parser_setting_takes_every_format() -> None:
    """`--tool-call-parser` (its choices in --help and docs/configuration.md) is `auto` or one of the formats."""
    import typing

    from config.settings import Settings

    choices = typing.get_args(Settings.model_fields["tool_call_parser"].annotation)
    assert set(choices) == {"auto", *FORMATS}
    described = Settings.model_fields["tool_call_parser"].description
    assert all(f"{name}:" in described for name in FORMATS)
