"""Reasoning output through a real server, on a tiny model that deterministically writes the markers.

The model is "scripted": one Llama layer whose attention and MLP outputs are zero, so the last hidden state is
the current token's (normalised) embedding, and an LM head whose row for token `next[t]` is that embedding of
`t`. Greedy decoding then follows a fixed chain whatever the context: `\\n` -> `<think>` -> reasoning tokens ->
`</think>` -> answer tokens -> EOS. The chat template ends the prompt with `assistant\\n` (the model then opens
`<think>` itself, Qwen3-style) or, for a system message "open", with `<think>` (DeepSeek-R1 style), so the
default `--reasoning-parser auto` is exercised both ways.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.support import build_byte_level_tokenizer

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if messages[0]['content'] == 'open' %}<think>{% endif %}{% endif %}"
)
REASONING_TEXT, ANSWER_TEXT = "Paged attention", "Hello world"


@dataclass(frozen=True)
class Scripted:
    path: Path
    reasoning: str
    answer: str


def build_scripted_model(path: Path) -> Scripted:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_byte_level_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    newline = tok.encode("<|im_start|>assistant\n")[-1]
    reasoning, answer = tok.encode(REASONING_TEXT), tok.encode(ANSWER_TEXT)
    chain = [newline, think, *reasoning, end, *answer, tok.eos_token_id]
    assert len(set(chain)) == len(chain), "the chain's tokens must be distinct"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                         rms_norm_eps=1e-6)
    torch.manual_seed(7)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        hidden = emb / emb.pow(2).mean(dim=-1, keepdim=True).sqrt()  # what the final RMSNorm makes of it
        model.lm_head.weight.zero_()
        for current, following in zip(chain, chain[1:], strict=False):
            model.lm_head.weight[following] = 5.0 * hidden[current] / hidden[current].norm()
    model.save_pretrained(path)
    return Scripted(path, tok.decode(reasoning), tok.decode(answer))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Scripted]]:
    from _tiny_server import TinyServer

    model = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    server = TinyServer(model.path, tmp_path_factory.mktemp("scripted-server"), "--max-model-len", "256")
    try:
        server.wait_ready()
        yield server.url, model
    finally:
        server.stop()


def messages(opened: bool) -> list[dict[str, str]]:
    return [{"role": "system", "content": "open" if opened else "closed"}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("opened", [False, True], ids=["model-opens-think", "prompt-opens-think"])
def test_reasoning_content_is_split_from_the_answer(scripted: tuple[str, Scripted], opened: bool) -> None:
    url, model = scripted
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="tiny", messages=messages(opened), temperature=0, max_tokens=20)
    message = reply.choices[0].message
    assert message.content == model.answer and reply.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == model.reasoning == message.model_extra["reasoning"]
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="tiny", messages=messages(opened), temperature=0,
                                                max_tokens=20, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert "<think>" not in (delta.content or "") and "</think>" not in (delta.content or "")
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (model.reasoning, model.answer)


def test_without_a_parser_the_markers_stay_in_content(scripted: tuple[str, Scripted]) -> None:
    """/v1/completions never parses reasoning: the raw text shows what the chat route split."""
    url, model = scripted
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 20}, timeout=120)
    assert r.json()["choices"][0]["text"] == f"<think>{model.reasoning}</think>{model.answer}"
    body = {"messages": messages(False), "temperature": 0, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert all(c["delta"] or c["finish_reason"] for c in choices), "no empty deltas but the last"


@pytest.mark.interop
@pytest.mark.timeout(3600)  # a first run builds the stack's venv
def test_llama_stack_passes_the_reasoning_through(scripted: tuple[str, Scripted],
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """A real Llama Stack 0.7 (remote::vllm) in front of the server: its chat answers carry the reasoning
    fields it reads (`reasoning`, `reasoning_content`), stream and not."""
    from test_llama_stack_server import RUN_YAML, run_stack

    url, model = scripted
    stack = run_stack(url, tmp_path_factory.mktemp("stack-reasoning"), RUN_YAML)
    stack_url = next(stack)
    try:
        body = {"model": "peregrine/tiny", "messages": messages(False), "temperature": 0, "max_tokens": 20}
        message = httpx.post(f"{stack_url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]["message"]
        assert (message["content"], message["reasoning"], message["reasoning_content"]) == (
            model.answer, model.reasoning, model.reasoning)
        with httpx.stream("POST", f"{stack_url}/v1/chat/completions", json=body | {"stream": True}, timeout=300) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == model.reasoning
        assert "".join(d.get("content") or "" for d in deltas) == model.answer
    finally:
        stack.close()
