"""The chat page at `/` in a real browser: headless Chromium (Debian's `chromium` package) driven by Playwright.

The page streams an answer equal to the API's own, shows streamed text arriving while the engine is still
generating, and its Stop button aborts the request in the engine (the batch empties, the KV cache is freed and
the abort is counted in /metrics, long before max_tokens). Tool calls and JSON answers are rendered from a
canned stream (the browser's network layer answers the request), errors from the server's envelope. A second
server, with auth on and a root path, shows the page asking for the key and keeping it in the tab only.

Skips, saying why, when `/usr/bin/chromium` (apt-get install chromium) or the `playwright` package is missing.
`scripts/setup.sh` installs both where it can. Screenshots go to the test's temporary folder; their paths are
printed (`pytest -s` shows them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api._browser import browser_fixture, page_fixture  # noqa: F401 - the browser and page fixtures
from tests.api._tiny_server import TinyServer, wait_until
from tests.support import free_port

pytestmark = pytest.mark.slow

SHORT_WAIT_MS = 60_000  # the tiny model answers in milliseconds
LONG_MAX_TOKENS = 1500
QUESTION = "What is the capital of France?"


def _metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample of GET /metrics, keyed `name` or `name{label=value}`."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            found[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return found


def _engine(http: httpx.Client) -> dict:
    return http.get("/health/engine").json()


def _idle(http: httpx.Client) -> bool:
    e = _engine(http)
    return e["running"] == 0 and e["waiting"] == 0 and e["kv_used_blocks"] == 0


def _open(page, url: str, model: str) -> None:
    page.goto(url)
    page.wait_for_function(
        "m => [...document.querySelectorAll('#model option')].some(o => o.value === m)", arg=model
    )
    page.select_option("#model", model)


def _ask(page, text: str, *, max_tokens: int, temperature: float = 0.0, extra: dict | None = None) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.eval_on_selector("#temperature", "(el, v) => { el.value = v; }", str(temperature))
    page.fill("#extra", json.dumps(extra) if extra else "")
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _last_answer(page):
    return page.locator(".msg.assistant").last


def test_page_streams_the_same_answer_as_the_api(page, server: str, http: httpx.Client, model_id: str) -> None:
    expected = http.post("/v1/chat/completions", json={
        "model": model_id, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
        "temperature": 0, "top_p": 1,
    }).json()["choices"][0]["message"]["content"]  # fmt: skip
    _open(page, f"{server}/", model_id)
    _ask(page, QUESTION, max_tokens=24)
    answer = _last_answer(page)
    page.wait_for_selector(".msg.assistant[data-finish] .meta")
    assert answer.get_attribute("data-finish") in ("stop", "length")
    assert answer.locator(".content").text_content() == expected  # every streamed piece, in order
    assert "tokens" in answer.locator(".meta").inner_text()  # usage arrived (stream_options.include_usage)


def test_stop_aborts_the_answer_in_the_engine(
    page, server: str, http: httpx.Client, model_id: str, tmp_path: Path
) -> None:
    wait_until(lambda: _idle(http), 600, "the engine to be idle")
    aborts = _metrics(http).get("peregrine_request_success_total{finished_reason=abort}", 0.0)
    _open(page, f"{server}/", model_id)
    page.fill("#system", "You are a storyteller who never stops.")
    _ask(page, "Tell me a very long story about a falcon.", max_tokens=LONG_MAX_TOKENS,
         extra={"ignore_eos": True})  # fmt: skip
    page.wait_for_function(
        "() => (document.querySelector('.msg.assistant.streaming .content') || {}).textContent?.length > 0"
    )
    seen = len(page.locator(".msg.assistant.streaming .content").text_content())
    page.wait_for_function(  # more text arrives while the request is still running: it streams
        "n => (document.querySelector('.msg.assistant.streaming .content') || {}).textContent?.length > n",
        arg=seen,
    )
    assert _engine(http)["running"] == 1, "the answer should still be generating"
    generated_before_stop = _engine(http)["generated_tokens_total"]
    shot = tmp_path / "chat-page-streaming.png"
    page.screenshot(path=str(shot))
    print(f"\nchat page screenshot (streaming): {shot}")

    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-finish='stopped']")
    wait_until(lambda: _idle(http), 120, "the engine to drop the stopped request and free its KV cache")
    after = _metrics(http)
    assert after["peregrine_request_success_total{finished_reason=abort}"] >= aborts + 1
    total = _engine(http)["generated_tokens_total"]
    assert total - generated_before_stop < LONG_MAX_TOKENS - 50, "the engine kept generating after Stop"
    assert page.is_hidden("#stop") and page.is_enabled("#send")
    shot = tmp_path / "chat-page-stopped.png"
    page.screenshot(path=str(shot))
    print(f"chat page screenshot (stopped): {shot}")


def test_errors_show_the_servers_message(page, server: str, model_id: str) -> None:
    _open(page, f"{server}/", model_id)
    _ask(page, "hello", max_tokens=8, extra={"temperature": 5})
    box = page.wait_for_selector(".msg.error-box")
    text = box.inner_text()
    assert "temperature" in text and "HTTP 400" in text and "invalid_request_error" in text
    assert page.locator(".msg.assistant").count() == 0  # the empty answer is not left behind


TOOL_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    ]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]  # fmt: skip
JSON_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": '{"name": "Paris",'}}]},
    {"choices": [{"index": 0, "delta": {"content": ' "population": 2100000}'}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
]


def _canned(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ": ping\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize("case", ["tool_calls", "json"])
def test_tool_calls_and_json_answers_are_shown_readably(page, server: str, model_id: str, case: str) -> None:
    stream = TOOL_STREAM if case == "tool_calls" else JSON_STREAM
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=_canned(stream)))  # fmt: skip
    _open(page, f"{server}/", model_id)
    _ask(page, "weather in Paris?", max_tokens=8)
    page.wait_for_selector(".msg.assistant[data-finish] .meta")
    answer = _last_answer(page)
    if case == "tool_calls":
        assert answer.get_attribute("data-finish") == "tool_calls"
        call = answer.locator(".tool-call")
        assert call.locator(".name").inner_text() == "get_weather"
        assert json.loads(call.locator("pre").inner_text()) == {"city": "Paris"}
        assert '\n  "city"' in call.locator("pre").inner_text()  # pretty-printed
    else:
        shown = answer.locator("pre.json").inner_text()
        assert json.loads(shown) == {"name": "Paris", "population": 2100000}
        assert '\n  "population"' in shown


class PrefixProxy:
    """A reverse proxy that serves `upstream` under `/peregrine` and strips the prefix, as nginx or Traefik
    would in front of `--root-path /peregrine`. Streams answers through chunk by chunk (aiohttp, own thread)."""

    PREFIX = "/peregrine"

    def __init__(self, upstream: str) -> None:
        import asyncio
        import threading

        self.upstream = upstream
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{self.PREFIX}"
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(60), "the proxy did not start"

    def _run(self, started) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_route("*", self.PREFIX + "{tail:.*}", self._forward)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        started.set()
        self.loop.run_forever()

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        path = request.match_info["tail"] or "/"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession() as session, session.request(
            request.method, self.upstream + path, headers=headers, data=await request.read()
        ) as upstream:
            out = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")})  # fmt: skip
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def proxied_auth_server(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefixProxy]:
    """The tiny model with auth on, behind a proxy that serves it under /peregrine (--root-path /peregrine)."""
    srv = TinyServer(tiny_model_dir.path, tmp_path_factory.mktemp("chat-auth"),
                     "--api-keys", "page-key", "--root-path", PrefixProxy.PREFIX)  # fmt: skip
    proxy = None
    try:
        srv.wait_ready()
        proxy = PrefixProxy(srv.url)
        yield proxy
    finally:
        if proxy is not None:
            proxy.close()
        srv.stop()


def test_behind_root_path_with_auth_the_key_stays_in_the_tab(page, proxied_auth_server: PrefixProxy) -> None:
    page.set_default_timeout(SHORT_WAIT_MS)
    page.goto(proxied_auth_server.url)  # no trailing slash: the page's <base> still resolves its URLs
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.locator("#model option").count() == 0
    page.fill("#api-key", "wrong-key")
    page.click("#key-form button[type=submit]")
    page.wait_for_function("() => document.querySelector('#key-error').textContent.length > 0")
    page.fill("#api-key", "page-key")
    page.click("#key-form button[type=submit]")
    page.wait_for_function("() => [...document.querySelectorAll('#model option')].some(o => o.value === 'tiny')")
    assert page.is_hidden("#key-form")
    _ask(page, "hello", max_tokens=8)
    page.wait_for_selector(".msg.assistant[data-finish] .meta")
    assert _last_answer(page).get_attribute("data-finish") in ("stop", "length")
    storage = page.evaluate("() => [JSON.stringify(localStorage), sessionStorage.getItem('peregrine.apiKey')]")
    assert storage == ["{}", "page-key"]
    assert page.context.cookies() == []
    assert httpx.get(f"{proxied_auth_server.url}/ui/chat.js", timeout=30).status_code == 200  # no key needed
    assert httpx.get(f"{proxied_auth_server.url}/v1/models", timeout=30).status_code == 401


def test_chat_page_route_is_open_and_relative(server: str) -> None:
    """No browser needed: `/` is HTML with a <base> and relative asset URLs, and needs no credentials."""
    r = httpx.get(f"{server}/", headers={"Accept": "text/html"}, timeout=30)  # what browsers send (others: Ollama's liveness)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<base href="/">' in r.text and 'src="ui/render.js"' in r.text and 'src="ui/chat.js"' in r.text
    assert "http" not in r.text.split("<body>")[0].replace('name="viewport"', "")  # nothing from a CDN
    for asset in ("ui/render.js", "ui/chat.js", "ui/chat.css"):
        assert httpx.get(f"{server}/{asset}", timeout=30).status_code == 200
