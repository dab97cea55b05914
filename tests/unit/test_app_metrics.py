"""GET /metrics on an app around a fake engine (no model): the numbers move the way the requests say."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import RequestTimer, path_templates, route_label, start_timer
from engine.types import EngineStats, RequestOutput, SamplingParams


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class FakeEngine:
    """Streams `tokens_per_request` one-token outputs per request, then finishes with "length"."""

    model_name, device, dtype, max_model_len, vocab_size = "fake", "cpu", "float32", 128, 100
    tokenizer = SimpleNamespace(  # one character per token, both ways
        decode=lambda ids, **_: "x" * len(ids), encode=lambda text, **_: [7] * len(text)
    )

    def __init__(self, tokens_per_request: int = 4) -> None:
        self.tokens = tokens_per_request
        self.running = 0
        self.preemptions = 0

    def check_prompt(self, prompt_len: int, max_tokens: int | None) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str):
        self.running += 1
        try:
            for i in range(1, self.tokens + 1):
                await asyncio.sleep(0.001)
                done = "length" if i == self.tokens else None
                yield RequestOutput(request_id, 0, "x", [5], len(prompt), i, finish_reason=done)
        finally:
            self.running -= 1

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, waiting=2, kv_used_blocks=3, kv_total_blocks=12, block_size=16,
                           preemptions_total=self.preemptions, prompt_tokens_total=0, generated_tokens_total=0,
                           steps_total=9, last_step_age_s=0.0, alive=True)  # fmt: skip


def settings() -> SimpleNamespace:
    return SimpleNamespace(
        host="127.0.0.1", api_key_list=(), jwt_secret=None, max_num_seqs=8, max_queue=8, max_body_bytes=1 << 20,
        request_timeout=600.0, rate_limit_per_s=0.0, rate_limit_burst=0, engine_stall_timeout=30.0,
        served_model_name=None, model="fake", stream_done_marker="auto",
    )  # fmt: skip


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine):
    from app.server import create_app

    app = create_app(engine, settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


async def get_metrics(client: httpx.AsyncClient) -> dict:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return scrape(r.text)


async def test_completions_move_the_counters(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    before = await get_metrics(client)
    assert value(before, "peregrine_prompt_tokens_total") == 0
    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    stream = await client.post("/v1/completions", json=body | {"stream": True})
    assert stream.status_code == 200 and "[DONE]" in stream.text
    after = await get_metrics(client)
    route = "/v1/completions"
    assert value(after, "peregrine_http_requests_total", route=route, method="POST", status="200") == 2
    assert value(after, "peregrine_prompt_tokens_total") == 6
    assert value(after, "peregrine_generation_tokens_total") == 8
    assert value(after, "peregrine_request_success_total", finished_reason="length") == 2
    for hist in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert value(after, f"peregrine_{hist}_count") == 2, hist
        assert value(after, f"peregrine_{hist}_sum") > 0, hist
    assert value(after, "peregrine_e2e_request_latency_seconds_sum") > value(
        after, "peregrine_time_to_first_token_seconds_sum"
    )
    assert value(after, "peregrine_http_requests_total", route="/metrics", method="GET", status="200") == 1


async def test_engine_gauges_and_errors(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.preemptions = 3
    missing = await client.get("/no/such/route")
    assert missing.status_code == 404
    bad = await client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert bad.status_code == 404
    samples = await get_metrics(client)
    assert value(samples, "peregrine_num_requests_running") == 0
    assert value(samples, "peregrine_num_requests_waiting") == 2
    assert value(samples, "peregrine_kv_cache_usage_ratio") == pytest.approx(0.25)
    assert value(samples, "peregrine_kv_cache_used_tokens") == 48
    assert value(samples, "peregrine_kv_cache_total_tokens") == 192
    assert value(samples, "peregrine_preemptions_total") == 3
    assert value(samples, "peregrine_http_requests_total", route="unmatched", method="GET", status="404") == 1
    post = {"route": "/v1/completions", "method": "POST", "status": "404"}
    assert value(samples, "peregrine_http_requests_total", **post) == 1


async def test_no_engine_yet_means_no_engine_gauges(engine: FakeEngine) -> None:
    from app.server import create_app

    app = create_app(None, settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        samples = await get_metrics(c)
    assert not any(name.startswith("peregrine_num_requests") for name, _ in samples)


def test_apps_have_separate_registries(engine: FakeEngine) -> None:
    from app.server import create_app

    one, two = create_app(engine, settings()), create_app(engine, settings())
    one.state.metrics.prompt_tokens.inc(5)
    assert "peregrine_prompt_tokens_total 5.0" in one.state.metrics.render()[0].decode()
    assert "peregrine_prompt_tokens_total 0.0" in two.state.metrics.render()[0].decode()


def test_timer_outside_a_request_is_a_no_op() -> None:
    timer = start_timer([3, 4])
    assert timer.metrics is None
    timer.on_output(0, RequestOutput("r", 0, "x", [1], 3, 1, finish_reason="stop"))
    timer.close()


def test_timer_counts_unfinished_sequences_as_aborted(engine: FakeEngine) -> None:
    from app.server import create_app

    metrics = create_app(engine, settings()).state.metrics
    timer = RequestTimer(metrics)
    for index in (0, 1):  # n=2: two sequences of one prompt
        timer.on_output(0, RequestOutput("r", index, "x", [1], 3, 1))
    timer.on_output(0, RequestOutput("r", 0, "", [], 3, 1, finish_reason="stop"))
    timer.close()
    samples = scrape(metrics.render()[0].decode())
    assert value(samples, "peregrine_request_success_total", finished_reason="stop") == 1
    assert value(samples, "peregrine_request_success_total", finished_reason="abort") == 1
    assert value(samples, "peregrine_time_to_first_token_seconds_count") == 2
    assert value(samples, "peregrine_time_per_output_token_seconds_count") == 0, "1 token: no TPOT"
    assert value(samples, "peregrine_generation_tokens_total") == 2


def test_route_label_matches_when_routing_never_ran(engine: FakeEngine) -> None:
    from app.server import create_app

    app = create_app(engine, settings())
    templates = path_templates(app.openapi()["paths"])
    scope = {"type": "http", "method": "GET", "path": "/v1/models/some/model"}
    assert route_label(scope, templates) == "/v1/models/{model_id}"
    assert route_label(scope | {"path": "/v1/completions"}, templates) == "/v1/completions"
    assert route_label(scope | {"path": "/v1/completions/x"}, templates) == "unmatched"
    assert route_label(scope | {"path": "/nope"}, templates) == "unmatched"


async def test_openmetrics_when_asked(client: httpx.AsyncClient) -> None:
    r = await client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF") and "peregrine_kv_cache_usage_ratio" in r.text
