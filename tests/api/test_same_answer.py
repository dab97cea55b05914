"""Same request, same answer (issue 35), on the default path: the bundled Q4_1 GGUF kept quantized, the one-call
C++ decoder, prefix caching on, at the ISA level this CPU picks by default, or the one `PEREGRINE_CPU_ISA` caps the
suite at (until 2026-12-04 this file ignored the cap and ran the CPU's best level whatever it said).
tests/engine/test_batch_invariance.py holds every level to the same bits in the engine, and
`PEREGRINE_SAME_ANSWER_LEVELS=all` runs these at every level (`none`, the op-by-op pass, takes minutes).

- 8 identical greedy requests sent at once give one answer, the one the request gets alone;
- a prompt sent twice (the second time its prefix comes from the prefix cache) gives the same answer;
- chunked prefill (a small `--max-num-batched-tokens` splits the prompt over steps) gives the same answer;
- a seeded sampled request gives the same text alone and among 7 other requests with differing prompts.

Two real servers per level on loopback (the default step size, and one that forces chunks), the real OpenAI SDK.
`--weight-format quantized` and `--dtype float32` are pinned because their `auto` defaults are timed at start, so
two servers could pick differently; both picks are the defaults' usual outcome here, and the guarantee holds for
either. Prompts span several KV blocks (block size 16).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from engine.backends import cpu_features
from tests.support import free_port, server_env, stop_process, wait_http_ok

# slow; the time limit covers starting two servers per level on a loaded 2-core machine (the suite's 900 s did not)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * 900 + 600)]
REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 900.0
LEVELS = (cpu_features.available_levels() if os.environ.get("PEREGRINE_SAME_ANSWER_LEVELS") == "all"
          else [cpu_features.isa_level(cap=os.environ.get(cpu_features.ENV, "auto"))])  # the suite's cap, if set
ARGS = ("--kv-cache-bytes", "256MiB", "--max-model-len", "2048", "--weight-format", "quantized", "--dtype", "float32")
TOKENS = 40
MATES = [
    "Write a short poem about the sea at night.",
    "List three uses of copper in houses.",
    "Why do cats purr? Explain briefly.",
    "Describe a busy train station in the morning.",
    "Give me a recipe idea with lentils and rice.",
    "What makes a good password? Answer in a few words.",
    "Tell a story about a lighthouse keeper and a storm.",
]


def question(tag: str) -> list[dict[str, str]]:
    """A chat of about 120 tokens (8 KV blocks), unique to the run so no earlier request's cache matches it."""
    system = (f"[{tag}] You are a careful assistant for a bird-watching club on the northern coast. Members ask "
              "about the birds they saw on their walks, the weather, the tides and the club's meetings. Answer "
              "plainly and say what you are unsure of.")
    user = ("On the cliffs this morning I watched a falcon dive very fast at a flock of pigeons over the harbour. "
            "What bird was it likely to be, and how fast can it fly?")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def launch(workdir: Path, level: str, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    env = {**server_env(), cpu_features.ENV: level}
    cmd = [sys.executable, str(REPO / "main.py"), "--host", "127.0.0.1", "--port", str(port), *ARGS, *extra]
    log_path = workdir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log_path


@pytest.fixture(scope="module", params=LEVELS)
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Per ISA level: clients of a server with the default step size and of one whose steps take 32 tokens
    (started together, each awaited with the suite's generous start timeout)."""
    workdir = tmp_path_factory.mktemp(f"same-{request.param}")
    started = {name: launch(workdir, request.param, *extra)
               for name, extra in (("default", ()), ("chunked", ("--max-num-batched-tokens", "32")))}
    try:
        for proc, url, log_path in started.values():
            wait_http_ok(f"{url}/ready", proc, log_path, READY_TIMEOUT_S)
        yield {name: openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
               for name, (_, url, _) in started.items()}
    finally:
        for proc, _, _ in started.values():
            stop_process(proc)


def ask(client: openai.OpenAI, messages: list[dict[str, str]], **params: object) -> str:
    params = {"temperature": 0, **params}
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                           max_tokens=TOKENS, **params)
    return reply.choices[0].message.content


def together(client: openai.OpenAI, requests: list[tuple[list[dict[str, str]], dict]]) -> list[str]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: ask(client, r[0], **r[1]), requests))


def test_identical_greedy_requests_together_and_alone(servers: dict) -> None:
    client = servers["default"]
    messages = question(uuid.uuid4().hex)
    answers = together(client, [(messages, {}) for _ in range(8)])  # a fresh prompt: computed in one step
    assert len(set(answers)) == 1, answers
    assert ask(client, messages) == answers[0]  # alone (its prompt from the cache now)
    fresh = question(uuid.uuid4().hex)
    alone = ask(servers["chunked"], fresh)  # alone, on a server that has not seen it, in chunks
    assert set(together(client, [(fresh, {}) for _ in range(8)])) == {alone}


def test_prompt_from_the_prefix_cache_gives_the_same_answer(servers: dict) -> None:
    client = servers["default"]
    messages = question(uuid.uuid4().hex)
    first = ask(client, messages)
    second = ask(client, messages)  # its prompt's whole blocks come from the cache this time
    assert second == first
    longer = [*messages, {"role": "assistant", "content": first}, {"role": "user", "content": "And its prey?"}]
    assert ask(client, longer) == ask(servers["chunked"], longer)  # a cached prefix, then the rest, vs in chunks


def test_chunked_prefill_gives_the_same_answer(servers: dict) -> None:
    messages = question(uuid.uuid4().hex)
    whole = ask(servers["default"], messages)
    chunked = ask(servers["chunked"], messages)  # the ~120-token prompt in steps of 32 tokens
    assert chunked == whole


def test_seeded_sample_alone_and_among_batch_mates(servers: dict) -> None:
    client = servers["default"]
    messages = question(uuid.uuid4().hex)
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    alone = ask(client, messages, **sampled)
    mates = [([{"role": "user", "content": text}], {"temperature": 0.8, "seed": i}) for i, text in enumerate(MATES)]
    batch = together(client, [(messages, sampled), *mates])
    assert batch[0] == alone
    assert ask(servers["chunked"], messages, **sampled) == alone
