"""`POST /tokenize` and `POST /detokenize`, shaped like vLLM's, to count tokens before sending.

`/tokenize` takes either `prompt` (plain text: the tokens /v1/completions would see) or `messages` (a chat,
rendered with the model's chat template: the tokens /v1/chat/completions would see). Both answer
`{"count", "max_model_len", "tokens", "token_strs"}`. `/detokenize` turns token ids back into text.
No engine request is made. They run on the event loop, like the chat route's own tokenization, so the
tokenizer is never used from two threads at once.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, model_validator

from app.chat.prompts import chat_prompt_text
from app.deps import engine_for
from app.errors import BadRequestError
from app.openai.schemas import ChatMessage

router = APIRouter(tags=["tokenizer"])


class TokenizeRequest(BaseModel):
    model: str | None = Field(None, description="The served model id (optional).")
    prompt: str | None = Field(None, description="Text to tokenize as /v1/completions would. Exclusive with "
                                                 "`messages`.")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A chat to render with the model's chat template, then tokenize as "
                                        "/v1/chat/completions would. Exclusive with `prompt`.")
    add_special_tokens: bool | None = Field(
        None, description="Let the tokenizer add its special tokens (BOS, ...). Default: true for `prompt`, "
                          "false for `messages` (the template writes them).")
    add_generation_prompt: bool = Field(
        True, description="`messages` only: end with the header that opens the assistant's turn (as chat "
                          "completions does).")
    continue_final_message: bool = Field(
        False, description="`messages` only: leave the last message open so a reply continues it (needs "
                           "add_generation_prompt false).")
    return_token_strs: bool = Field(False, description="Also return each token's text in `token_strs`.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = Field(None, description="The served model id (optional).")
    tokens: list[int] = Field(..., description="Token ids, each in [0, vocabulary size).")


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Tokenize text or a chat (vLLM's `POST /tokenize`), e.g. to count tokens before sending.

    Send `prompt` (text) or `messages` (a chat, rendered with the model's chat template; `add_generation_prompt`,
    default true, and `continue_final_message` as in vLLM). `add_special_tokens` defaults to true for
    `prompt` and false for `messages`. The answer: `tokens` (ids), `count`, the model's `max_model_len`
    (prompt plus output must fit in it), and `token_strs` (each token's text) when `return_token_strs` is true.
    """
    engine, _ = await engine_for(request, body.model)
    tokenizer = engine.tokenizer
    if body.messages is not None:
        text = chat_prompt_text(tokenizer, body.messages, body.add_generation_prompt,
                                     body.continue_final_message)
        ids = list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=special))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """Turn token ids back into text (vLLM's `POST /detokenize`): `{"tokens": [...]}` -> `{"prompt": "..."}`.

    Special tokens are kept in the text. An id outside the vocabulary is a 400 naming `tokens`.
    """
    engine, _ = await engine_for(request, body.model)
    bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
    if bad:
        raise BadRequestError(f"Token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size}).",
                              param="tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))
