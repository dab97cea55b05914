"""The chat templates Peregrine ships (models/chat_templates: llama.cpp's vendored copies of each family's real
template) and the tool-call parser each one gets: every template renders a tool round trip (tools, the
assistant's call, the tool's result) through transformers' `apply_chat_template` with a real `tokenizers`
tokenizer; `--tool-call-parser auto` picks the parser from the template's text; the assistant call as the template
itself writes it, and the family's own model output, both parse back to the call. Also: how the template is
chosen (`--chat-template`, the model's own, the architecture's family, none) and the 400 without one."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from app.chat import harmony
from app.chat.plan import plan_tools
from app.chat.prompts import chat_prompt_text
from app.chat.tool_parsers import FORMATS, CallStream, detect, parse
from app.errors import BadRequestError
from app.openai.convert import tools_request
from app.openai.schemas import ChatCompletionRequest, ChatMessage
from models import chat_templates
from models.chat_templates import BY_ARCHITECTURE, NAMES, ChatTemplateError, choose, named
from tests.support import build_byte_level_tokenizer

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USER = "Weather in Paris?"
CALL_ID = "abcDEF123"  # Mistral's templates take 9 alphanumeric characters only
HISTORY = [
    {"role": "user", "content": USER},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "21 C"},
]  # fmt: skip

# template -> (the parser auto picks, what the family's model generates for the call)
FAMILIES = {
    "qwen2.5": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    "qwen3": ("hermes", '<think>\nA tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}\n</tool_call>'),
    "hermes3": ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'),
    "granite4": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    "llama3.1": ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "llama3.2": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "mistral-nemo": ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                     '"id": "abcDEF123"}]'),
    "mistral-small": ("mistral_args", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    "granite3.3": ("granite", '<|tool_call|>[{"arguments": {"city": "Paris"}, "name": "get_weather"}]'),
    "phi4-mini": ("phi4_mini", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>'),
    # harmony: read through app/chat/harmony.py's channels first (`readable`)
    "gpt-oss": ("harmony", '<|channel|>analysis<|message|>A tool.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'),
    # no tool support in the template: Peregrine's default tool prompt and the smollm2 format
    "gemma": ("smollm2", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'),
    "phi3.5": ("smollm2", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'),
    "deepseek-r1": ("smollm2", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'),
}
DROPS_PAST_CALLS = {"granite3.3"}  # its template renders an assistant turn's content only, never its tool_calls


@pytest.fixture(scope="module")
def base_tokenizer() -> Any:
    return build_byte_level_tokenizer()


def with_template(tokenizer: Any, name: str) -> Any:
    tokenizer.chat_template = named(name)
    return tokenizer


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    request = ChatCompletionRequest.model_validate({"messages": messages, "tools": [
        {"type": "function", "function": WEATHER}]})  # fmt: skip
    plan = plan_tools(tools_request(request), tokenizer, "auto")
    return chat_prompt_text(tokenizer, [ChatMessage.model_validate(m) for m in messages], tool_plan=plan)


def readable(fmt_name: str, text: str) -> str:
    """The text the tool parser reads: harmony's channels rewritten by the reasoning layer, others as they are."""
    return harmony.split(text)[1] if fmt_name == "harmony" else text


def only_call(fmt_name: str, text: str) -> tuple[str, dict[str, Any]]:
    _, calls = parse(FORMATS[fmt_name], readable(fmt_name, text), frozenset({"get_weather"}))
    assert len(calls) == 1, (fmt_name, text)
    return calls[0].name, json.loads(calls[0].arguments)


def test_every_name_has_a_family_entry_and_a_file() -> None:
    assert set(FAMILIES) == set(NAMES)
    assert set(BY_ARCHITECTURE.values()) <= set(NAMES)
    assert all((chat_templates.HERE / f"{n}.jinja").is_file() for n in NAMES)


def test_every_name_is_in_the_settings_help_and_the_docs() -> None:
    """`--help` (the setting's description) and docs/chat-templates.md list the names `--chat-template` takes."""
    from config.settings import Settings

    described = Settings.model_fields["chat_template"].description
    docs = (Path(__file__).resolve().parents[2] / "docs" / "chat-templates.md").read_text(encoding="utf-8")
    listed = re.findall(r"[\w.-]+", described.split("server knows (")[1].split(";")[0])
    assert listed == list(NAMES)
    assert all(f"`{name}`" in docs for name in NAMES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_auto_picks_the_parser_from_the_template_text(name: str) -> None:
    assert detect(named(name)) == FAMILIES[name][0]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_template_renders_a_tool_round_trip_that_parses_back(base_tokenizer: Any, name: str) -> None:
    """The tools reach the prompt; the assistant's call as the template writes it is what the parser reads."""
    tokenizer = with_template(base_tokenizer, name)
    text = render(tokenizer, HISTORY)
    declared = '"get_weather"' in text or "type get_weather = " in text  # JSON, or gpt-oss's TypeScript namespace
    assert declared and "Weather in a city" in text and "21 C" in text
    after_user = text.split(USER)[-1]
    if name in DROPS_PAST_CALLS:
        assert "tool_calls" not in named(name) and "<|tool_call|>" not in after_user
        return
    assert only_call(FAMILIES[name][0], after_user) == ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_tool_without_descriptions_renders(base_tokenizer: Any, name: str) -> None:
    """OpenAI's `description` is optional; gpt-oss's and Hermes 3's templates read it unguarded."""
    tokenizer = with_template(base_tokenizer, name)
    bare = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    request = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [{"type": "function",
                                                                                   "function": bare}]})
    text = chat_prompt_text(tokenizer, [ChatMessage.model_validate(m) for m in HISTORY],
                            tool_plan=plan_tools(tools_request(request), tokenizer, "auto"))
    assert "get_weather" in text and "21 C" in text


@pytest.mark.parametrize(("name", "written"), [
    ("gpt-oss", "<|start|>assistant<|channel|>analysis<|message|>Paris, then.<|end|><|start|>assistant to=functions"),
    ("qwen3", "<|im_start|>assistant\n<think>\nParis, then.\n</think>\n\n<tool_call>"),
])  # fmt: skip
def test_a_tool_turns_reasoning_sent_back_reaches_the_template(base_tokenizer: Any, name: str, written: str) -> None:
    """`reasoning_content` on an earlier assistant turn (as this API returned it): Qwen3's template renders it as
    `reasoning_content`, gpt-oss's as `thinking`; beside text content on a tool-call turn (which gpt-oss's template
    refuses with reasoning) the content alone."""
    tokenizer = with_template(base_tokenizer, name)
    history = [HISTORY[0], HISTORY[1] | {"reasoning_content": "Paris, then."}, HISTORY[2]]
    assert written in render(tokenizer, history)
    with_text = [HISTORY[0], HISTORY[1] | {"content": "Checking.", "reasoning_content": "Paris, then."}, HISTORY[2]]
    assert "Checking." in render(tokenizer, with_text)


def test_qwen3s_enable_thinking_through_chat_template_kwargs(base_tokenizer: Any) -> None:
    """vLLM's `chat_template_kwargs`: Qwen3's template closes an empty think block when thinking is off."""
    import asyncio

    from app.chat.plan import build_plan
    from app.openai.convert import chat_plan

    tokenizer = with_template(base_tokenizer, "qwen3")

    def prompt(**extra: Any) -> str:
        request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **extra})
        plan = asyncio.run(build_plan(tokenizer, chat_plan(request, len(tokenizer))))
        return tokenizer.decode(plan.prompts[0], skip_special_tokens=False)

    assert prompt().endswith("<|im_start|>assistant\n")
    off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_familys_output_parses_whole_and_streamed(name: str) -> None:
    parser, output = FAMILIES[name]
    assert only_call(parser, output) == ("get_weather", {"city": "Paris"})
    output = readable(parser, output)
    stream = CallStream(FORMATS[parser], frozenset({"get_weather"}))
    deltas = [d for i, ch in enumerate(output) for d in stream.feed(ch, final=i == len(output) - 1)[1]]
    assert deltas[0].name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}


def test_reasoning_templates_are_recognised() -> None:
    from app.chat.reasoning import parser_enabled

    class Tok:
        def __init__(self, template: str) -> None:
            self.chat_template = template

    assert parser_enabled("auto", Tok(named("qwen3"))) and parser_enabled("auto", Tok(named("deepseek-r1")))
    assert not parser_enabled("auto", Tok(named("llama3.1")))


# ---------------------------------------------------------------- which template


def test_the_setting_wins_then_the_models_own_then_the_family(tmp_path: Path) -> None:
    own = "{{ messages }}"
    assert choose("qwen3", own, "llama").text == named("qwen3")
    file = tmp_path / "mine.jinja"
    file.write_text("{{ 'mine' }}")
    assert choose(str(file), own, None).text == "{{ 'mine' }}"
    assert choose(None, own, "llama").text == own
    family = choose(None, None, "qwen3")
    assert family.text == named("qwen3") and "qwen3" in family.source
    assert choose(None, None, "gemma3_text").text == named("gemma")
    assert choose(None, None, "gpt2").text is None


def test_a_setting_that_is_no_file_and_no_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="neither a file nor one of the known templates"):
        choose("qwen9", None, None)
    empty = tmp_path / "empty.jinja"
    empty.write_text(" \n")
    with pytest.raises(ChatTemplateError, match="empty"):
        choose(str(empty), None, None)


def test_without_a_template_chat_is_a_400_that_says_how_to_pass_one(base_tokenizer: Any) -> None:
    base_tokenizer.chat_template = None
    with pytest.raises(BadRequestError, match="--chat-template") as err:
        chat_prompt_text(base_tokenizer, [ChatMessage.model_validate({"role": "user", "content": "hi"})])
    assert "qwen3" in str(err.value) and "/v1/completions" in str(err.value)


@pytest.mark.parametrize("name", ["mistral-nemo", "mistral-small"])
def test_mistral_templates_take_the_servers_call_ids(base_tokenizer: Any, name: str) -> None:
    """Peregrine's ids (`call_` + 24 hex) become the 9 alphanumeric characters Mistral's templates demand, the
    same on the call and on its result."""
    history = json.loads(json.dumps(HISTORY).replace(CALL_ID, "call_0123456789abcdef01234567"))
    text = render(with_template(base_tokenizer, name), history)
    short = hashlib.sha256(b"call_0123456789abcdef01234567").hexdigest()[:9]
    assert text.count(short) == 2 and "call_0123" not in text
