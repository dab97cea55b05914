"""A client that leaves mid-stream aborts its engine request: the batch empties and its KV memory is freed
long before the request's max_tokens would have been generated (read from GET /metrics)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 1500  # the server's context is 2048: far more than any machine generates before the client leaves
WAIT_S = 600.0


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _wait_idle(http: httpx.Client) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (
            _metric(http, "peregrine_num_requests_running") == 0
            and _metric(http, "peregrine_kv_cache_used_tokens") == 0
        ):
            return
        time.sleep(0.5)
    pytest.fail("the engine did not go idle")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_client_leaving_mid_stream_aborts_the_request(http: httpx.Client, model_id: str, route: str) -> None:
    _wait_idle(http)
    steps_before = _metric(http, "peregrine_engine_steps_total")
    body = {"model": model_id, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True, "temperature": 0}
    body |= (
        {"messages": [{"role": "user", "content": "Count to a thousand."}]}
        if "chat" in route
        else {"prompt": "1, 2, 3,"}
    )
    with (
        httpx.Client(base_url=str(http.base_url), timeout=300) as own,
        own.stream("POST", route, json=body) as r,
    ):
        assert r.status_code == 200
        seen = []  # what the stream sent, for the failure message
        # Held until the connection is meant to close: a dropped line iterator is finalized at once, and
        # closing it closes the connection (httpcore), which aborts the request before the check below.
        lines = r.iter_lines()
        for line in lines:
            seen.append(line)
            if line.startswith("data: {") and _has_text(json.loads(line[6:])):
                break
        running = _metric(http, "peregrine_num_requests_running")
        assert running == 1, (  # still generating
            f"running {running}, waiting {_metric(http, 'peregrine_num_requests_waiting')}, preemptions "
            f"{_metric(http, 'peregrine_preemptions_total')}; the stream sent: {seen[-4:]}"
        )
    # The connection is closed here, with most of the tokens still to come.
    _wait_idle(http)
    assert _metric(http, "peregrine_engine_steps_total") - steps_before < MAX_TOKENS


def _has_text(event: dict) -> bool:
    choice = (event.get("choices") or [{}])[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def test_client_leaving_before_a_non_stream_answer_aborts_the_request(
    http: httpx.Client, model_id: str
) -> None:
    _wait_idle(http)
    steps_before = _metric(http, "peregrine_engine_steps_total")
    body = {"model": model_id, "prompt": "1, 2, 3,", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 3 s without an answer and hangs up
        httpx.post(
            f"{str(http.base_url).rstrip('/')}/v1/completions", json=body, timeout=httpx.Timeout(60, read=3)
        )
    _wait_idle(http)
    assert _metric(http, "peregrine_engine_steps_total") - steps_before < MAX_TOKENS
