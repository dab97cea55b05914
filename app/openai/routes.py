"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Routers stay thin: find the engine and check the model name (`app/deps.py`), convert the request
(`app/openai/convert.py`, prompts by `app/chat/prompts.py`), run it (`app/engine_client.py`: a prompt that does not
fit is a 400 before any streaming starts), convert the outputs back. `stream: true` in the body selects SSE, whatever the Accept header says.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.chat import reasoning
from app.chat.plan import build_plan
from app.chat.prompt_logprobs import PromptScoring, score_only
from app.chat.prompts import completion_prompts
from app.deps import (
    Engine,
    engine_for,
    generates,
    generation_defaults,
    get_engine,
    reasoning_parser,
    request_id,
    served_names,
    tool_call_parser,
)
from app.engine_client import generate
from app.errors import model_not_found
from app.llama_stack.schemas import native_model_fields
from app.openai import convert as conv
from app.openai import embeddings, stored
from app.openai import tools as openai_tools
from app.openai.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from app.streaming import stream_format, stream_response

router = APIRouter(prefix="/v1", tags=["openai"])
STARTED_AT = int(time.time())


@router.post("/chat/completions", response_model=ChatCompletionResponse)
@generates
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> Response | ChatCompletionResponse:
    """Chat completion (OpenAI `POST /v1/chat/completions`).

    Renders `messages` with the model's chat template and generates a reply. `stream: true` returns
    server-sent events (`chat.completion.chunk` objects, then `data: [DONE]`); with
    `stream_options.include_usage` a last chunk with empty `choices` carries `usage`. Besides the OpenAI
    fields, vLLM's extra sampling keys are accepted at top level: `top_k`, `min_p`,
    `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
    `include_stop_str_in_output`, and `chat_template_kwargs` (variables for the chat template, e.g.
    `{"enable_thinking": false}` for Qwen3); `reasoning_effort` reaches the template too (gpt-oss).

    Reasoning models: the thinking between `<think>` and `</think>` comes in `message.reasoning_content`
    (and `delta.reasoning_content` in streams; both also as `reasoning`), the answer in `content`; the
    server's `--reasoning-parser` (auto, none, deepseek_r1, qwen3, gpt_oss) chooses how; gpt-oss's analysis
    channel is its reasoning. vLLM's `prompt_logprobs` extra returns the prompt tokens' logprobs in the
    top-level `prompt_logprobs`.

    Tools: `tools`, `tool_choice` (none, auto, required, or a named function) and `parallel_tool_calls`.
    Calls come back in `message.tool_calls` with `finish_reason: "tool_calls"` (streams: OpenAI's tool-call
    deltas, the name first, then argument fragments). `required` and a named function are constrained to a
    valid call from the first token; with `auto`, a call the model starts is constrained from there on. The
    model's own format is parsed (`--tool-call-parser`: auto, hermes, llama3_json, mistral, mistral_args,
    granite, phi4_mini, harmony, smollm2).
    """
    engine, model = await engine_for(request, body.model, body.keep_alive)
    plan = await build_plan(engine.tokenizer, conv.chat_plan(body, engine.vocab_size, generation_defaults(request)), tool_call_parser(request))
    params, tool_plan = plan.params, plan.tool_plan
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = generate(engine, plan.prompts, params, rid, prompt_param="messages")
    splitter = reasoning.splitter_factory(reasoning_parser(request), engine.tokenizer, plan.prompts[0])
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = conv.chat_chunks(outputs, id=rid, model=model, n=params.n, include_usage=include_usage)
        if splitter is not None:
            events = reasoning.split_chunks(events, splitter)
        if plan.parses_tools:
            events = openai_tools.split_chunks(events, tool_plan.new_stream)
        if stored.wanted(request, body):
            events = stored.remember_stream(request, body, events)
        return stream_response(events, stream_format(request, openai=True), request_id=request_id(request))
    result = conv.ChatResult(id=rid, model=model, n=params.n, want_logprobs=params.logprobs is not None)
    async for _, out in outputs:
        result.add(out)
    response = result.response() if splitter is None else reasoning.split_response(result.response(), splitter)
    if plan.parses_tools:
        response = openai_tools.split_response(response, tool_plan)
    if stored.wanted(request, body):
        await stored.remember(request, body, response)
    return response


@router.post("/completions", response_model=CompletionResponse)
@generates
async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
    """Text completion (OpenAI `POST /v1/completions`).

    `prompt` may be a string, a list of strings, a list of token ids, or a list of lists of token ids;
    each prompt gets `n` choices (choice index = prompt index * n + i). `logprobs` (an int, or a bool
    meaning 1) returns OpenAI's legacy logprobs object; `echo` prepends the prompt to the text.
    `stream: true` returns server-sent events of `text_completion` chunks, then `data: [DONE]`.

    Scoring (lm-evaluation-harness and other evaluation tools): with `echo` and `logprobs` the logprobs
    object covers the prompt tokens first (`token_logprobs[0]` is null: the first token has no context),
    then the generated ones; `max_tokens: 0` with `echo` generates nothing (`finish_reason: "length"`).
    vLLM's `prompt_logprobs: k` adds `choices[i].prompt_logprobs` (null, then per token
    `{token id: {logprob, rank, decoded_token}}` for the token and the k most likely). Prompt logprobs come
    from the prefill and cost nothing to requests that do not ask.
    """
    engine, model = await engine_for(request, body.model, body.keep_alive)
    texts, ids = zip(*completion_prompts(engine.tokenizer, body.prompt, engine.vocab_size), strict=True)
    plan = await build_plan(engine.tokenizer, conv.completion_plan(body, engine.vocab_size, ids, generation_defaults(request)))
    params = plan.params
    rid = f"cmpl-{uuid.uuid4().hex}"
    outputs = generate(engine, plan.prompts, params, rid, prompt_param="prompt")
    echo = [text if body.echo else "" for text in texts]
    scoring = PromptScoring.of(engine.tokenizer, ids, body.echo, params.logprobs, body.prompt_logprobs)
    if body.max_tokens == 0:
        outputs = score_only(outputs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = conv.completion_chunks(
            outputs, id=rid, model=model, n=params.n, prompt_texts=echo, include_usage=include_usage,
            scoring=scoring,
        )
        return stream_response(events, stream_format(request, openai=True), request_id=request_id(request))
    result = conv.CompletionResult(
        id=rid, model=model, n=params.n, prompt_texts=echo, want_logprobs=params.logprobs is not None,
        scoring=scoring,
    )
    async for p, out in outputs:
        result.add(p, out)
    return result.response()


def model_card(request: Request, engine: Engine) -> ModelCard:
    return _card(engine.model_name, engine.max_model_len)


def _card(name: str, max_model_len: int | None, **extra: Any) -> ModelCard:
    return ModelCard(
        id=name,
        created=STARTED_AT,
        max_model_len=max_model_len,
        custom_metadata={"model_type": "llm", "provider_id": "peregrine", "provider_resource_id": name},
        **native_model_fields(name, "llm", {}),
        **extra,
    )


def _registry_cards(registry: Any) -> list[ModelCard]:
    """Every served model with its state ("loaded", "loading", "unloaded", "unloading") and memory figures."""
    cards = []
    for slot in registry.slots.values():
        engine = slot.engine
        max_len = engine.max_model_len if engine is not None else slot.spec.max_model_len
        info = registry.describe(slot)
        cards.append(_card(slot.spec.name, max_len, state=info["state"], status=info))
    return cards


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The served models, in OpenAI's list shape. `custom_metadata` carries what Llama Stack reads
    (`model_type`, `provider_id`, `provider_resource_id`). A server with several models adds `state`
    (loaded, loading, unloaded, unloading) and `status` (memory need, keep-alive, requests in flight) to each."""
    registry = getattr(request.app.state, "models", None)
    cards = _registry_cards(registry) if registry is not None else [model_card(request, get_engine(request))]
    return ModelList(data=[*cards, *embeddings.embedding_cards(request)])


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """One model. The answer has both OpenAI's fields (`id`, `object`, ...) and llama-stack-client's
    (`identifier`, `provider_resource_id`, `type`, `model_type`), so both clients can read it."""
    if (embedding := embeddings.embedding_model_detail(request, model_id)) is not None:
        return embedding
    registry = getattr(request.app.state, "models", None)
    if registry is not None:
        name = registry.slot(model_id).spec.name
        card = next(c for c in _registry_cards(registry) if c.id == name).model_dump()
    else:
        engine = get_engine(request)
        if model_id not in served_names(request, engine):
            raise model_not_found(model_id, [engine.model_name])
        card = model_card(request, engine).model_dump()
        name = engine.model_name
    return card | {
        "identifier": name,
        "provider_resource_id": name,
        "provider_id": "peregrine",
        "type": "model",
        "metadata": {},
        "model_type": "llm",
    }
