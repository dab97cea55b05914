"""A tool call through each family's real chat template, end to end: one real server (`--models-file`) serving a
tiny random-weight GGUF of each family (tests/family_gguf.py: the architecture's tensor layout and metadata, served
quantized on the fast path) with the family's own template in the file's `tokenizer.chat_template`, as a
downloaded GGUF carries it; Qwen3, Qwen2.5 and Llama 3.1 with their real tokenizers (llama.cpp's vocab-only GGUFs,
where `<tool_call>` and `<|python_tag|>` are single special tokens), Gemma 2 and 3 with a SentencePiece one (Llama 2's),
the others with the byte-level test tokenizer. Phi-4-mini's format (tools on the system message, calls in
`<|tool_call|>...<|/tool_call|>`) is served from a `phi3` file, as Phi-4-mini's GGUFs are.

For each, through the `openai` SDK: a forced call (tool_choice naming the function: the grammar writes the call in
the format `--tool-call-parser auto` read from the template) streams, is parsed back into `tool_calls` with valid
arguments, and the conversation goes on with the tool's result through the same template. The weights are random,
so only forced calls are asserted; the free text is not."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import openai
import pytest

from models.chat_templates import named
from tests.family_gguf import write_family
from tests.llama_cpp import source
from tests.support import build_byte_level_tokenizer, main_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# family -> (chat template, llama.cpp vocab or None for the byte-level tokenizer)
FAMILIES = {
    "qwen3": ("qwen3", "qwen2"),
    "qwen2": ("qwen2.5", "qwen2"),
    "llama3": ("llama3.1", "llama-bpe"),
    "mistral": ("mistral-nemo", None),
    "granite": ("granite3.3", None),
    "phi3": ("phi3.5", None),
    "phi4-mini": ("phi4-mini", None),  # a `phi3` file (Phi-4-mini's are) with a tied LM head and its format
    "gemma3": ("gemma", "llama-spm"),  # Gemma's tokenizer is SentencePiece, as this one
    "gemma2": ("gemma", "llama-spm"),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris?"}]


FILES = Path.home() / ".cache" / "peregrine" / "test-families"  # the files are the same every run: written once


def write_model(family: str) -> Path:
    template, vocab = FAMILIES[family]
    folder = FILES / f"{family}-{vocab or 'bytes'}-{hashlib.sha256(named(template).encode()).hexdigest()[:8]}-v1"
    if (folder / "tiny.gguf").is_file():
        return folder / "tiny.gguf"
    FILES.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=FILES))
    if vocab is None:
        tokenizer = build_byte_level_tokenizer()
        size = len(tokenizer) + (-len(tokenizer)) % 32
        write_family(tmp, family, size, tokenizer=tokenizer, chat_template=named(template), context=4096)
    else:
        vocab_file = source() / "vendor" / "llama.cpp" / "models" / f"ggml-vocab-{vocab}.gguf"
        tokens = len(gguf.GGUFReader(vocab_file).fields["tokenizer.ggml.tokens"].contents())
        write_family(tmp, family, tokens + (-tokens) % 32, vocab_file=vocab_file, chat_template=named(template),
                     context=4096)  # fmt: skip
    (tmp / "config.json").unlink()  # only the file, as a user downloads it
    try:
        tmp.rename(folder)
    except OSError:  # another run published it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder / "tiny.gguf"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    workdir = tmp_path_factory.mktemp("families")
    lines = [f"  - {{model: '{write_model(f)}', name: {f}, kv_cache_bytes: 64MiB}}" for f in FAMILIES]
    (workdir / "models.yaml").write_text("models:\n" + "\n".join(lines) + "\n")
    args = ("--models-file", str(workdir / "models.yaml"), "--model-load-wait", "900", "--log-level", "info")
    with main_server(workdir, *args) as (url, _log):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forced_call_streams_through_the_familys_template(api: openai.OpenAI, family: str) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    deltas = []
    with api.chat.completions.stream(model=family, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                     max_tokens=300, temperature=0, stream_options={"include_usage": True}) as stream:  # fmt: skip
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.append(event.arguments_delta)
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather", (family, final.choices[0])
    arguments = json.loads(calls[0].function.arguments)
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 8
    assert final.choices[0].finish_reason == "tool_calls" and "".join(deltas) == calls[0].function.arguments
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": calls[0].function.arguments}}]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C"}]  # fmt: skip
    answer = api.chat.completions.create(model=family, messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=8)  # fmt: skip
    assert answer.choices[0].message.tool_calls in (None, [])
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage.prompt_tokens > final.usage.prompt_tokens  # the call and its result reached the prompt


@pytest.mark.parametrize(("family", "bos"), [("llama3", "<|begin_of_text|>"), ("qwen2", None)])
def test_raw_prompts_start_with_bos_where_llama_cpp_adds_one(api: openai.OpenAI, family: str, bos: str | None) -> None:
    """llama.cpp's vocab-only files have no `tokenizer.ggml.add_bos_token`: llama.cpp then adds a BOS for Llama 3's
    BPE and none for Qwen's (models/gguf_weights.adds_bos; tests/engine/test_gguf_bos.py), and so does Peregrine on
    a raw prompt; a chat prompt gets the one its template writes, not two."""
    base = str(api.base_url).rstrip("/").removesuffix("/v1")

    def tokens(**body: object) -> list[str]:
        reply = httpx.post(f"{base}/tokenize", json={"model": family, "return_token_strs": True, **body}, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()["token_strs"]

    raw, bare = tokens(prompt="Hello world"), tokens(prompt="Hello world", add_special_tokens=False)
    assert raw == ([bos] if bos else []) + bare and bare and bos not in bare, (raw, bare)
    if bos is not None:  # the template writes the chat's BOS; the tokenizer adds none to it
        chat = tokens(messages=ASK)
        assert chat[0] == bos and chat.count(bos) == 1, chat
