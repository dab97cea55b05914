"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A thin front over the chat pipeline: the request is converted to the chat form (`app/anthropic/convert.py`), run
through the same steps as `POST /v1/chat/completions` (`app/anthropic/pipeline.py`), and rendered as an Anthropic
message or event stream (`app/anthropic/events.py`). Errors, including those of the shared layers, answer in
Anthropic's envelope (`app/anthropic/errors.py`). `anthropic-version` and `anthropic-beta` are accepted whatever
their value, as is `?beta=true` (Claude Code appends it).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.anthropic import pipeline
from app.anthropic.convert import Finish, to_chat_request, to_message
from app.anthropic.events import AnthropicSSE, message_events
from app.anthropic.schemas import ERROR_RESPONSES, CountTokensRequest, Message, MessagesRequest, TokenCount
from app.deps import generates, request_id
from app.streaming import stream_response

router = APIRouter(prefix="/v1", tags=["anthropic"])


@router.post("/messages", response_model=Message, responses=ERROR_RESPONSES)
@generates
async def create_message(body: MessagesRequest, request: Request) -> Response | Message:
    """A message (Anthropic `POST /v1/messages`).

    `system` (a string or text blocks), `messages` with `text`, `tool_use` and `tool_result` blocks (`image` blocks
    are a 400: the served models read text only; `thinking` blocks sent back are dropped), `max_tokens` (required),
    `stop_sequences`, `temperature` (0-1), `top_p`, `top_k`, `tools` (client tools with `input_schema`) and
    `tool_choice` (`auto`, `any`, `tool`, `none`; `any` and `tool` are constrained to a valid call from the first
    token), `thinking` and `metadata` (accepted). A reasoning model's thinking comes back as `thinking` blocks.
    `stream: true` returns Anthropic's server-sent events: `message_start`, `ping`, per block
    `content_block_start` / `content_block_delta` (`text_delta`, `thinking_delta`, `input_json_delta`) /
    `content_block_stop`, then `message_delta` (`stop_reason`: end_turn, max_tokens, stop_sequence, tool_use;
    `usage`) and `message_stop`. `usage.cache_read_input_tokens` counts prompt tokens the prefix cache supplied.
    """
    plan = await pipeline.plan(request, to_chat_request(body))
    rid, finish = f"msg_{uuid.uuid4().hex}", Finish()
    if body.stream:
        chunks = pipeline.chunks(request, plan, rid, finish)
        events = message_events(chunks, id=rid, model=plan.model, prompt_tokens=len(plan.prompt), finish=finish,
                                stop_sequences=body.stop_sequences)
        return stream_response(events, AnthropicSSE(), request_id=request_id(request))  # type: ignore[arg-type]
    response = await pipeline.answer(request, plan, rid, finish)
    return to_message(response, finish, body)


@router.post("/messages/count_tokens", response_model=TokenCount, responses=ERROR_RESPONSES)
async def count_message_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    """The prompt's size in tokens (Anthropic `POST /v1/messages/count_tokens`): the conversation, `system` and
    `tools` rendered by the model's chat template exactly as `POST /v1/messages` would feed them to the model."""
    plan = await pipeline.plan(request, to_chat_request(body), for_counting=True)
    return TokenCount(input_tokens=len(plan.prompt))
