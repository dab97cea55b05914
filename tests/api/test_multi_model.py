"""Several models in one real server (`python main.py --models-file ...`): the bundled SmolLM2 beside the tiny
random model, served under four names:

- `smollm2` (listed first: the default, loaded at start, keep_alive -1),
- `tiny` (loaded on demand),
- `tiny-wide` (the tiny model with a 900 MiB KV cache: it fits the 1 GiB budget only once SmolLM2, counted as its
  96.6 MB of quantized weights and a 128 MiB KV cache, is unloaded),
- `huge` (the tiny model with a 2 GiB KV cache: more than the whole budget, refused with the arithmetic).

`--model-load-wait 0.001` makes every request that has to wait for a load answer 503 with Retry-After (the load
goes on); `chat` retries as a client should, and reports whether it had to.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api._browser import browser_fixture, page_fixture  # noqa: F401 - the browser and page fixtures
from tests.api._tiny_server import wait_until
from tests.support import main_server

pytestmark = pytest.mark.slow

WAIT_S = 600.0  # a SmolLM2 load on a busy 2-core machine can take a while


@pytest.fixture(scope="module")
def multi(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    workdir = tmp_path_factory.mktemp("multi")
    tiny = tiny_model_dir.path
    (workdir / "models.yaml").write_text(
        "models:\n"
        "  - {model: 'bundled:smollm2', kv_cache_bytes: 128MiB, max_model_len: 2048, keep_alive: -1}\n"
        f"  - {{model: '{tiny}', name: tiny}}\n"
        f"  - {{model: '{tiny}', name: tiny-wide, kv_cache_bytes: 900MiB}}\n"
        f"  - {{model: '{tiny}', name: huge, kv_cache_bytes: 2GiB}}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEREGRINE_")}
    args = ("--models-file", "models.yaml", "--dtype", "float32", "--embedding-model", "none",
            "--models-memory-budget", "1GiB", "--model-load-wait", "0.001", "--model-keep-alive", "5m")
    with main_server(workdir, *args, env=env, ready_timeout=WAIT_S) as (url, _), \
            httpx.Client(base_url=url, timeout=300) as client:
        wait_until(lambda: _states(client)["smollm2"] == "loaded", WAIT_S, "the default model to load")
        yield client


def _states(http: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["state"] for m in http.get("/v1/models").json()["data"] if "state" in m}


def _metrics(http: httpx.Client) -> dict[str, float]:
    found = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            found[f"{s.name}{{{s.labels.get('model', '')}}}"] = s.value
    return found


def chat(http: httpx.Client, model: str | None, **extra) -> tuple[dict, list[httpx.Response]]:
    """A chat answer, retrying 503s after their Retry-After as a client should; returns the 503s too."""
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
            "temperature": 0} | ({"model": model} if model else {}) | extra  # fmt: skip
    refused = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = http.post("/v1/chat/completions", json=body)
        if r.status_code != 503:
            assert r.status_code == 200, r.text
            return r.json(), refused
        refused.append(r)
        time.sleep(min(float(r.headers.get("retry-after", "1")), 2.0))
    pytest.fail(f"{model} never answered: {refused[-1].text if refused else ''}")


def test_models_listed_with_their_state(multi: httpx.Client) -> None:
    models = {m["id"]: m for m in multi.get("/v1/models").json()["data"]}
    assert list(models) == ["smollm2", "tiny", "tiny-wide", "huge"]
    assert models["smollm2"]["state"] == "loaded" and models["smollm2"]["max_model_len"] == 2048
    assert models["huge"]["status"]["memory_bytes"] > 2 * 2**30
    health = multi.get("/health").json()
    assert health["engine"] == "ready" and health["models"]["smollm2"] == "loaded"
    assert multi.get("/v1/models/tiny").json()["id"] == "tiny"
    assert multi.get("/v1/models/nope").status_code == 404


def test_requests_are_routed_by_model_and_load_on_demand(multi: httpx.Client) -> None:
    answer, _ = chat(multi, None)  # no model: the default
    # the bundled model's greedy first token is a near tie here ("The" / "L", 0.1-0.4 nats apart): check the route,
    # not the words
    assert answer["model"] == "smollm2" and answer["choices"][0]["message"]["content"].strip()
    was = _states(multi)["tiny"]
    answer, refused = chat(multi, "tiny")
    assert answer["model"] == "tiny" and answer["usage"]["completion_tokens"] >= 1
    if was == "unloaded":  # it had to load: the first try was told to come back
        assert refused and refused[0].json()["error"]["code"] == "model_loading"
        assert int(refused[0].headers["retry-after"]) >= 1
    assert _states(multi)["tiny"] == "loaded" and _states(multi)["smollm2"] == "loaded"
    metrics = _metrics(multi)
    assert metrics["peregrine_model_loaded{tiny}"] == 1 and metrics["peregrine_model_loaded{smollm2}"] == 1
    assert metrics["peregrine_engine_steps_total{tiny}"] >= 1
    engine = multi.get("/health/engine").json()["models"]
    assert engine["tiny"]["state"] == "loaded" and engine["tiny"]["kv_used_blocks"] == 0
    hello = [{"role": "user", "content": "x"}]
    bad = multi.post("/v1/chat/completions", json={"model": "tiny", "keep_alive": "soon", "messages": hello})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"
    missing = multi.post("/v1/chat/completions", json={"model": "nope", "messages": hello})
    assert missing.status_code == 404 and "smollm2, tiny, tiny-wide, huge" in missing.json()["error"]["message"]


def test_idle_model_is_unloaded_after_the_requests_keep_alive(multi: httpx.Client) -> None:
    unloads = _metrics(multi)["peregrine_model_unloads_total{tiny}"]
    chat(multi, "tiny", keep_alive="1s")
    wait_until(lambda: _states(multi)["tiny"] == "unloaded", 120, "tiny to be unloaded after keep_alive 1s")
    after = _metrics(multi)
    assert after["peregrine_model_unloads_total{tiny}"] == unloads + 1
    assert after["peregrine_gc_frozen_objects{}"] > 50_000  # unfrozen for the unload's collection, frozen again
    engine = multi.get("/health/engine").json()["models"]["tiny"]
    assert engine["state"] == "unloaded" and "kv_total_blocks" not in engine  # no engine, no KV cache
    assert "peregrine_kv_cache_total_tokens{tiny}" not in _metrics(multi)
    assert _states(multi)["smollm2"] == "loaded"  # keep_alive -1: stays


def test_chat_page_lists_the_models_and_waits_for_a_load(page, multi: httpx.Client) -> None:
    """The chat page's model picker shows every model with its state; a request for an unloaded model is told to
    come back (503 + Retry-After) and the page retries until the answer streams."""
    was = _states(multi)["tiny"]
    page.goto(f"{multi.base_url}/")
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 4")
    labels = page.locator("#model option").all_inner_texts()
    assert labels[0] == "smollm2" and labels[1] == ("tiny" if was == "loaded" else f"tiny ({was})")
    page.select_option("#model", "tiny")
    page.fill("#max-tokens", "8")
    page.fill("#prompt", "hello")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant[data-finish] .meta")
    assert page.locator(".msg.assistant").last.get_attribute("data-finish") in ("stop", "length")
    assert page.locator(".msg.error-box").count() == 0
    if was == "unloaded":  # the page saw the 503 and said so while it waited
        assert page.locator(".msg.assistant .note").count() == 1
    page.wait_for_function(  # the picker refreshes after the answer
        "() => [...document.querySelectorAll('#model option')].some(o => o.textContent === 'tiny')"
    )


def test_memory_budget_unloads_idle_models_and_refuses_what_cannot_fit(multi: httpx.Client) -> None:
    answer, _ = chat(multi, "tiny-wide")  # SmolLM2's 96.6 MB + 128 MiB, + 900 MiB > 1 GiB: SmolLM2 makes room
    assert answer["model"] == "tiny-wide"
    states = _states(multi)
    assert states["tiny-wide"] == "loaded" and states["smollm2"] == "unloaded"

    refused = multi.post("/v1/chat/completions", json={"model": "huge", "messages": [{"role": "user", "content": "x"}]})
    error = refused.json()["error"]
    assert refused.status_code == 503 and error["code"] == "model_too_large" and "retry-after" not in refused.headers
    assert "KV cache 2.1 GB" in error["message"] and "--models-memory-budget" in error["message"]
    assert "1.1 GB" in error["message"]  # the budget, in the same units
    assert _states(multi)["huge"] == "unloaded"

    answer, refused = chat(multi, "smollm2")  # back again: loading it unloads tiny-wide
    assert answer["choices"][0]["message"]["content"].strip()
    assert refused and all(int(r.headers["retry-after"]) >= 1 for r in refused)
    states = _states(multi)
    assert states["smollm2"] == "loaded" and states["tiny-wide"] == "unloaded"


def _ollama(http: httpx.Client, route: str, body: dict) -> dict:
    """An Ollama /api answer, retrying its 503s (the model loading) after their Retry-After."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = http.post(route, json={"stream": False, **body})
        if r.status_code != 503:
            assert r.status_code == 200, r.text
            return r.json()
        assert isinstance(r.json()["error"], str)  # Ollama's envelope
        time.sleep(min(float(r.headers.get("retry-after", "1")), 2.0))
    pytest.fail(f"{route} never answered")


def test_ollama_keep_alive_loads_and_unloads_through_the_registry(multi: httpx.Client) -> None:
    """Ollama's keep_alive on the registry: an empty request loads the model, `keep_alive: 0` unloads it (at once
    when idle), and a request with `keep_alive: 0` leaves it unloaded after its answer."""
    assert [m["name"] for m in multi.get("/api/tags").json()["models"]] == ["smollm2", "tiny", "tiny-wide", "huge"]
    loaded = _ollama(multi, "/api/generate", {"model": "tiny"})
    assert loaded["done"] and loaded["done_reason"] == "load" and _states(multi)["tiny"] == "loaded"
    running = {m["name"]: m for m in multi.get("/api/ps").json()["models"]}
    assert "tiny" in running and running["tiny"]["expires_at"] > "2026"
    unloaded = _ollama(multi, "/api/chat", {"model": "tiny", "messages": [], "keep_alive": 0})
    assert unloaded["done_reason"] == "unload" and _states(multi)["tiny"] == "unloaded"
    assert "tiny" not in {m["name"] for m in multi.get("/api/ps").json()["models"]}
    answer = _ollama(multi, "/api/chat", {"model": "tiny", "keep_alive": 0, "options": {"num_predict": 4},
                                          "messages": [{"role": "user", "content": "hello"}]})  # fmt: skip
    assert answer["done"] and answer["eval_count"] <= 4
    wait_until(lambda: _states(multi)["tiny"] == "unloaded", 120, "tiny to be unloaded after keep_alive 0")
