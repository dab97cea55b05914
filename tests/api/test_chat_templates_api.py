"""Chat templates through a real server on the tiny random Llama (tests/conftest.py), its tokenizer's own template
removed: without `--chat-template` it is served with its architecture's family format (llama -> llama3.1, said in
the start log) and completions work; with `--chat-template qwen2.5` (the real Qwen2.5 template Peregrine ships) a
forced tool call (tool_choice naming the function: the grammar forces the call's JSON) streams through the `openai`
SDK and round-trips: the call, the tool's result, an answer; the same with `--chat-template gpt-oss` (the harmony
format: the forced call is written in harmony's channels and read back through them; `reasoning_effort` and
`chat_template_kwargs` reach its template, which cannot be given the server's own inputs). A tiny random GPT-2
(an architecture that names no family format) without a template: chat routes answer 400 saying how to pass one,
completions work."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.api._tiny_server import TinyServer

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def bare_model(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: ANN001 - TinyModel
    """The tiny model with no chat template of its own (and room for a real template's prompt)."""
    path = tmp_path_factory.mktemp("tiny-no-template") / "model"
    shutil.copytree(tiny_model_dir.path, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    model_config = json.loads((path / "config.json").read_text())  # the real templates' system prompts are long
    (path / "config.json").write_text(json.dumps(model_config | {"max_position_embeddings": 2048}))
    return path


@pytest.fixture(scope="module")
def gpt2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.support import build_byte_level_tokenizer

    path = tmp_path_factory.mktemp("tiny-gpt2") / "model"
    tokenizer = build_byte_level_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(path)
    yield from serve(path, tmp_path_factory.mktemp("gpt2"))


def serve(model: Path, workdir: Path, *args: str) -> Iterator[TinyServer]:
    server = TinyServer(model, workdir, "--log-level", "info", *args)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def family_server(bare_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    yield from serve(bare_model, tmp_path_factory.mktemp("family"))


@pytest.fixture(scope="module")
def qwen_server(bare_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    yield from serve(bare_model, tmp_path_factory.mktemp("qwen"), "--chat-template", "qwen2.5")


@pytest.fixture(scope="module")
def harmony_server(bare_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    yield from serve(bare_model, tmp_path_factory.mktemp("gpt-oss"), "--chat-template", "gpt-oss")


def client(server: TinyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)


def test_a_model_without_a_template_gets_its_familys(family_server: TinyServer) -> None:
    assert "chat template: the llama family's format (llama3.1)" in family_server.log_tail(200_000)
    chat = client(family_server).chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    assert chat.choices[0].finish_reason in ("length", "stop")
    done = client(family_server).completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert done.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("template", ["qwen2.5", "gpt-oss"])
def test_a_forced_tool_call_streams_and_round_trips(template: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("qwen_server" if template == "qwen2.5" else "harmony_server")
    assert f"chat template: --chat-template {template}" in server.log_tail(200_000)
    api = client(server)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with api.chat.completions.stream(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                     max_tokens=200, temperature=0) as stream:  # fmt: skip
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    arguments = json.loads(calls[0].function.arguments)
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 8
    assert final.choices[0].finish_reason == "tool_calls"
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": calls[0].function.arguments}}]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C"}]  # fmt: skip
    answer = api.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=8)  # fmt: skip
    assert answer.choices[0].message.tool_calls in (None, [])
    assert answer.choices[0].finish_reason in ("length", "stop") and answer.usage.prompt_tokens > 0


def test_no_template_and_no_family_chat_is_a_400_completions_work(gpt2_server: TinyServer) -> None:
    assert "architecture names no family format" in gpt2_server.log_tail(200_000)
    with pytest.raises(openai.BadRequestError) as err:
        client(gpt2_server).chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    assert err.value.body["param"] == "messages" and "--chat-template" in err.value.body["message"]
    legacy = httpx.post(f"{gpt2_server.url}/v1/inference/chat-completion", timeout=60, json={
        "model_id": "tiny", "messages": ASK})  # fmt: skip
    assert legacy.status_code == 400 and "--chat-template" in legacy.text
    done = client(gpt2_server).completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4


def test_reasoning_effort_and_template_kwargs_reach_the_template(harmony_server: TinyServer) -> None:
    """gpt-oss's template writes `Reasoning: <effort>` (default medium) in its system message."""
    api = client(harmony_server)

    def prompt_tokens(**extra: object) -> int:
        answer = api.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, extra_body=extra or None)
        return answer.usage.prompt_tokens

    medium, high = prompt_tokens(), prompt_tokens(reasoning_effort="high")
    assert high != medium
    assert prompt_tokens(chat_template_kwargs={"reasoning_effort": "high"}) == high
    assert prompt_tokens(reasoning_effort="medium", chat_template_kwargs={"unused": 1}) == medium
    for bad in ({"chat_template_kwargs": {"add_generation_prompt": False}}, {"reasoning_effort": "extreme"}):
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, extra_body=bad)

    def ollama_prompt_tokens(**extra: object) -> int:  # Ollama's `think` level: the same variable
        body = {"model": "tiny", "messages": ASK, "stream": False, "options": {"num_predict": 1}, **extra}
        answer = httpx.post(f"{harmony_server.url}/api/chat", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["prompt_eval_count"]

    assert ollama_prompt_tokens(think="high") == high and ollama_prompt_tokens() == medium
