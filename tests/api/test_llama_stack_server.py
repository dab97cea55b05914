"""A real Llama Stack server (llama-stack 0.7.x, Python 3.12) whose only inference provider is Peregrine.

The stack runs `examples/llama-stack-run.yaml` (the file docs/llama-stack.md shows) with `PEREGRINE_URL` pointing at
the test server's /v1, on a free loopback port, from its own cached virtual environment; it is stopped by
its PID. llama-stack-client 0.7.x then talks to the stack only, and must get Peregrine's answers; the openai
SDK, pointed at the stack's OpenAI-compatible routes, gets tool calls and JSON-schema answers through it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import yaml

from tests.interop.harness import check_embeddings, check_generation, direct, embedding_id, run_client
from tests.interop.venvs import CLIENT_MODERN, SERVER, ensure_venv
from tests.support import free_port, server_env, stop_process, wait_http_ok

# A first run builds the clients' (and the stack's) venvs inside setup: allow for it beyond the default 900 s.
pytestmark = [pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(3600)]
__all__ = ["direct", "embedding_id"]  # fixtures, imported so pytest finds them here
RUN_YAML = Path(__file__).resolve().parents[2] / "examples" / "llama-stack-run.yaml"
START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def stack(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from run_stack(server, tmp_path_factory.mktemp("llama-stack"), RUN_YAML)


@pytest.fixture(scope="module")
def discovering_stack(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same run config without its `registered_resources` (no `models:` list): the stack finds
    Peregrine's models by listing /v1/models, and its remote::vllm adapter types them by name."""
    workdir = tmp_path_factory.mktemp("llama-stack-discovery")
    config = yaml.safe_load(RUN_YAML.read_text())
    config.pop("registered_resources")
    run_yaml = workdir / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(config))
    yield from run_stack(server, workdir, run_yaml)


def run_stack(server: str, workdir: Path, run_yaml: Path) -> Iterator[str]:
    venv = ensure_venv(SERVER)
    port = free_port()
    env = server_env("LLAMA_STACK_")
    env |= {"PEREGRINE_URL": f"{server}/v1", "SQLITE_STORE_DIR": str(workdir / "store"), "HOME": str(workdir),
            "LLAMA_STACK_HOST": "127.0.0.1"}  # fmt: skip
    log = workdir / "stack.log"
    cmd = [str(venv / "bin" / "llama"), "stack", "run", str(run_yaml), "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/v1/health", proc, log, START_TIMEOUT_S, what="llama stack")
        yield url
    finally:
        stop_process(proc, 60)


def test_llama_stack_serves_peregrine(
    stack: str, model_id: str, embedding_id: str, direct: dict[str, Any]
) -> None:
    llm_id, emb_id = f"peregrine/{model_id}", f"peregrine/{embedding_id}"
    seen = run_client(
        CLIENT_MODERN, "lsc_modern.py", stack, llm_id, emb_id, "models,chat,completions,embeddings"
    )
    assert seen["models"][llm_id]["model_type"] == "llm"
    assert seen["models"][llm_id]["provider_resource_id"] == model_id
    assert seen["models"][emb_id]["model_type"] == "embedding"
    assert seen["retrieve_embedding"]["provider_resource_id"] == embedding_id
    check_generation(seen, direct)
    check_embeddings(seen, direct)


def test_llama_stack_discovers_the_embedding_model_without_a_models_list(
    discovering_stack: str, model_id: str, embedding_id: str, direct: dict[str, Any]
) -> None:
    assert "embed" in embedding_id  # the default served name is one remote::vllm types as an embedding model
    llm_id, emb_id = f"peregrine/{model_id}", f"peregrine/{embedding_id}"
    seen = run_client(CLIENT_MODERN, "lsc_modern.py", discovering_stack, llm_id, emb_id, "models,embeddings")
    assert seen["models"][llm_id]["model_type"] == "llm"
    assert seen["models"][emb_id]["model_type"] == "embedding"
    check_embeddings(seen, direct)


STACK_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
STACK_CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["name", "country"], "additionalProperties": False}


def test_llama_stack_chat_with_tools_and_json_schema(stack: str, model_id: str) -> None:
    """Through the stack's OpenAI-compatible chat (remote::vllm -> Peregrine): a tool call, streamed and not, and
    a JSON-schema answer, each valid."""
    client = openai.OpenAI(base_url=f"{stack}/v1", api_key="none", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    llm_id = f"peregrine/{model_id}"
    r = client.chat.completions.create(model=llm_id, messages=ask, tools=[STACK_TOOL], tool_choice="required",
                                       temperature=0, max_tokens=100)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    chunks = list(client.chat.completions.create(model=llm_id, messages=ask, tools=[STACK_TOOL], max_tokens=100,
                                                 tool_choice="required", temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
    r = client.chat.completions.create(
        model=llm_id, messages=[{"role": "user", "content": "Describe Paris."}], temperature=0, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": STACK_CITY, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), STACK_CITY)
