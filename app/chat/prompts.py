"""Prompt building, shared by every API family: chat messages through the model's chat template, and raw
completion prompts (strings or token ids) checked against the vocabulary."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from app.chat import tools
from app.chat.tools import ToolPlan
from app.errors import BadRequestError
from app.openai.schemas import ChatMessage
from models import chat_templates


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> Sequence[int]:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise BadRequestError(
                f"Token id {token_id} is outside the vocabulary [0, {vocab_size}).", param=param
            )
    return ids


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage], tool_plan: ToolPlan | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it (no extra BOS: the
    template writes every special token the model expects)."""
    text = chat_prompt_text(tokenizer, messages, tool_plan=tool_plan, template_kwargs=template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_text(tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                     continue_final_message: bool = False, tool_plan: ToolPlan | None = None,
                     template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The conversation rendered with the chat template the model is served with (models/chat_templates); tool
    definitions and tool-call turns as `app/chat/tools.py` prepares them for that template; `template_kwargs`: the
    request's own template variables (`chat_template_kwargs`, `reasoning_effort`). A model without a template
    gets a 400 that says how to pass one: a format it was not trained on would make it answer garbage."""
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        raise BadRequestError(
            "This model has no chat template, so chat messages cannot be formatted for it. Start the server with "
            f"--chat-template FILE (a Jinja chat template) or a known name ({', '.join(chat_templates.NAMES)}); "
            "/v1/completions works without one.", param="messages",
        )
    conversation = [_template_message(i, m) for i, m in enumerate(messages)]
    conversation, tool_defs = tools.template_input(conversation, tool_plan, own if isinstance(own, str) else None)
    options = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "tools": tool_defs, "tokenize": False}
    try:
        return tokenizer.apply_chat_template(conversation, **options)
    except Exception as exc:  # jinja's TemplateError, or a template's own raise_exception(...)
        merged = _system_in_first_user(conversation)
        if merged is not None:  # Gemma's template takes no system turn: it goes first in the user's, as Gemma 3's does
            with contextlib.suppress(Exception):
                return tokenizer.apply_chat_template(merged, **options)
        raise BadRequestError(f"The chat template rejected these messages: {exc}", param="messages") from None


def _system_in_first_user(conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    if len(conversation) < 2 or conversation[0]["role"] != "system" or conversation[1]["role"] != "user":
        return None
    first = conversation[1] | {"content": f"{conversation[0]['content']}\n\n{conversation[1]['content']}"}
    return [first, *conversation[2:]]


def _template_message(i: int, msg: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
    out["content"] = _text_content(i, msg.content)
    for key in ("name", "tool_call_id", "tool_calls"):
        if getattr(msg, key) is not None:
            out[key] = getattr(msg, key)
    extra = msg.model_extra or {}
    thinking = extra.get("reasoning_content", extra.get("reasoning"))
    if msg.role == "assistant" and isinstance(thinking, str) and thinking and not (out["content"] and msg.tool_calls):
        # an earlier turn's reasoning, as this API returned it: Qwen3's template reads `reasoning_content`, gpt-oss's
        # `thinking` (transformers fills it from this), which it refuses beside text content on a tool-call turn
        out["reasoning_content"] = thinking
    return out


def _text_content(i: int, content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise BadRequestError(
                f"Only text content parts are supported (got type {part.type!r}).",
                param=f"messages[{i}].content",
            )
        texts.append(part.text)
    return "".join(texts)


def completion_prompts(tokenizer: Any, prompt: Any, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt; `prompt` is a string, strings, token ids, or lists of token ids.
    The text (what `echo` prepends) is the prompt as sent, or the decoded ids."""
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise BadRequestError("prompt must not be empty.", param="prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            text, ids = p, list(tokenizer.encode(p))
        else:
            ids = list(check_token_ids(p, vocab_size, "prompt"))
            text = tokenizer.decode(ids)
        if not ids:
            raise BadRequestError("prompt must not be empty.", param="prompt")
        out.append((text, ids))
    return out


def completion_prompt_ids(tokenizer: Any, prompt: Any, vocab_size: int) -> list[list[int]]:
    """The token ids of each prompt (see `completion_prompts`)."""
    return [ids for _, ids in completion_prompts(tokenizer, prompt, vocab_size)]
