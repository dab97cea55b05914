"""GET /metrics on a real server: scraped before, during and after real requests, the numbers move as they
should (the server is shared with other API tests, so everything is checked as a difference)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
COMPLETIONS = "/v1/completions"
TOKENS = 160  # long enough that the scrape taken after the first token still sees the request running


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(http: httpx.Client, check, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(http)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_metrics_move_during_and_after_a_stream(server: str, http: httpx.Client, model_id: str) -> None:
    before = scrape(http)
    assert get(before, "peregrine_engine_alive") == 1
    # the server froze what its load left alive (models/engine_factory.freeze_heap): libraries, tokenizer, model
    assert get(before, "peregrine_gc_frozen_objects") > 50_000
    total_tokens = get(before, "peregrine_kv_cache_total_tokens")
    assert total_tokens > 0
    body = {"model": model_id, "prompt": "Peregrine falcons hunt", "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    during: dict = {}
    usage: dict = {}
    with (
        httpx.Client(base_url=server, timeout=300) as streamer,
        streamer.stream("POST", COMPLETIONS, json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if not during and event.get("choices") and event["choices"][0].get("text"):
                during = scrape(http)  # the sequence is running and holds KV blocks right now
    assert get(during, "peregrine_num_requests_running") >= 1
    assert get(during, "peregrine_kv_cache_used_tokens") > 0
    assert 0 < get(during, "peregrine_kv_cache_usage_ratio") <= 1
    assert get(during, "peregrine_time_to_first_token_seconds_count") == (
        get(before, "peregrine_time_to_first_token_seconds_count") + 1
    ), "TTFT is observed as soon as the first token leaves the engine"
    assert usage["completion_tokens"] == TOKENS

    ok = {"route": COMPLETIONS, "method": "POST", "status": "200"}
    counted = get(before, "peregrine_http_requests_total", **ok) + 1

    def settled(s: dict) -> bool:  # a request is counted once its ASGI call returns, just after [DONE]
        return (
            get(s, "peregrine_num_requests_running") == 0
            and get(s, "peregrine_http_requests_total", **ok) == counted
        )

    after = wait_for(http, settled)

    def moved(name: str, **labels: str) -> float:
        return get(after, name, **labels) - get(before, name, **labels)

    assert get(after, "peregrine_num_requests_running") == 0
    assert get(after, "peregrine_kv_cache_used_tokens") == get(after, "peregrine_kv_cache_usage_ratio") == 0
    assert moved("peregrine_prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("peregrine_generation_tokens_total") == TOKENS
    assert moved("peregrine_request_success_total", finished_reason="length") == 1
    for hist in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert moved(f"peregrine_{hist}_count") == 1, hist
        assert moved(f"peregrine_{hist}_sum") > 0, hist
    assert moved("peregrine_e2e_request_latency_seconds_sum") > moved(
        "peregrine_time_to_first_token_seconds_sum"
    )
    assert moved("peregrine_http_requests_total", **ok) == 1
    assert moved("peregrine_engine_steps_total") >= TOKENS
    assert get(after, "peregrine_kv_cache_total_tokens") == total_tokens


def test_requests_are_counted_by_route_and_status(http: httpx.Client, model_id: str) -> None:
    before = scrape(http)
    assert (
        http.post(COMPLETIONS, json={"model": model_id, "prompt": "hi", "max_tokens": 2}).status_code == 200
    )
    assert http.post(COMPLETIONS, json={"model": "no-such-model", "prompt": "hi"}).status_code == 404
    assert (
        http.post(COMPLETIONS, json={"model": model_id, "prompt": "hi", "max_tokens": -1}).status_code == 400
    )
    assert http.get("/v1/models").status_code == 200
    assert http.get("/no/such/path").status_code == 404

    def moved_in(samples: dict, route: str, method: str, status: str) -> float:
        labels = {"route": route, "method": method, "status": status}
        return get(samples, "peregrine_http_requests_total", **labels) - get(
            before, "peregrine_http_requests_total", **labels
        )

    # each request is counted when its ASGI call returns, a moment after the client has the answer
    after = wait_for(http, lambda s: moved_in(s, "unmatched", "GET", "404") == 1)

    def moved(route: str, method: str, status: str) -> float:
        return moved_in(after, route, method, status)

    assert moved(COMPLETIONS, "POST", "200") == 1
    assert moved(COMPLETIONS, "POST", "404") == 1
    assert moved(COMPLETIONS, "POST", "400") == 1
    assert moved("/v1/models", "GET", "200") == 1
    assert moved("unmatched", "GET", "404") == 1
    assert moved("/metrics", "GET", "200") >= 1, "the first scrape is counted by the later ones"
