"""Prometheus metrics: `GET /metrics`, one registry per app instance.

Three sources feed it:

- `MetricsMiddleware` counts every HTTP request by route template, method and status (a route that
  matched nothing is labelled "unmatched", so random paths cannot blow up the label set).
- `RequestTimer` follows one engine request from `app/engine_client.generate` (the single place every API
  family runs the engine): time to first token, time per output token, end-to-end latency, prompt and
  generated token counters, finished sequences by finish reason. It finds the app's metrics through a
  context variable that the middleware sets for the duration of the request, so routes need no plumbing.
- `EngineCollector` reads `engine.stats()` at scrape time: running and waiting sequences, KV cache usage
  (fraction and tokens), preemptions, prefix cache queries and hits (in tokens, as vLLM counts them), the
  HTTP admission counters when `app/limits.py` installed them, and the objects the load froze
  (`models/engine_factory.freeze_heap`).

Each `create_app` gets its own `CollectorRegistry` (never the process-global default), so several apps in
one process, as in the tests, do not collide. Names follow vLLM's where one exists, prefixed `peregrine_`.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.types import RequestOutput

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
UNMATCHED = "unmatched"

_current: ContextVar[AppMetrics | None] = ContextVar("peregrine_app_metrics", default=None)
"""The metrics of the app serving the current request; set by MetricsMiddleware, read by start_timer."""


class AppMetrics:
    """The metric objects of one app, registered in that app's own registry."""

    def __init__(self, app: FastAPI) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.http_requests = Counter(
            "peregrine_http_requests",
            "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "status"],
            registry=reg,
        )
        self.ttft = Histogram(
            "peregrine_time_to_first_token_seconds",
            "Time from the engine request to its first generated token, per sequence.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "peregrine_time_per_output_token_seconds",
            "Mean time per output token after the first, per finished sequence.",
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "peregrine_e2e_request_latency_seconds",
            "Time from the engine request to the sequence's last token, per finished sequence.",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter("peregrine_prompt_tokens", "Prompt tokens received.", registry=reg)
        self.generation_tokens = Counter("peregrine_generation_tokens", "Tokens generated.", registry=reg)
        self.finished = Counter(
            "peregrine_request_success",
            "Sequences finished, by finish reason (stop, length, abort, error).",
            ["finished_reason"],
            registry=reg,
        )
        reg.register(EngineCollector(app))

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition in the format the scraper's Accept header asks for (Prometheus text by default,
        OpenMetrics when asked) and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def install_metrics(app: FastAPI) -> AppMetrics:
    """Give `app` its registry, the request-counting middleware and `GET /metrics`. Call it before the
    outermost middlewares are added, so that their answers (401, 429, ...) are counted too."""
    metrics = AppMetrics(app)
    app.state.metrics = metrics
    app.add_middleware(MetricsMiddleware, metrics=metrics, fastapi_app=app)
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], tags=["metrics"],
                      response_class=Response)  # fmt: skip
    return metrics


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus metrics in the text exposition format: HTTP requests by route and status; TTFT, TPOT and
    end-to-end latency histograms; prompt and generated token counters; running and waiting sequences;
    KV cache usage (fraction and tokens); preemptions; prefix cache queries and hits (tokens)."""
    body, content_type = request.app.state.metrics.render(request.headers.get("accept", ""))
    return Response(body, headers={"Content-Type": content_type})


class MetricsMiddleware:
    """Counts each HTTP request once, when its answer is complete (for a stream: when the stream ends)."""

    def __init__(self, app: ASGIApp, metrics: AppMetrics, fastapi_app: FastAPI) -> None:
        self.app = app
        self.metrics = metrics
        self.fastapi_app = fastapi_app
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what an exception escaping before the response started becomes
        token = _current.set(self.metrics)

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _current.reset(token)
            route = route_label(scope, self.templates)
            self.metrics.http_requests.labels(route, scope.get("method", ""), str(status)).inc()

    @property
    def templates(self) -> list[tuple[re.Pattern[str], str]]:
        if self._templates is None:  # built on first use: every route is registered by then
            self._templates = path_templates(self.fastapi_app.openapi().get("paths", {}))
        return self._templates


def route_label(scope: Scope, templates: Iterable[tuple[re.Pattern[str], str]]) -> str:
    """The route template (`/v1/models/{model_id}`) of a request, or UNMATCHED.

    Routing leaves the matched route in the scope. A request refused before routing (auth, limits) has
    none, so its path is matched against the documented templates instead.
    """
    route = scope.get("route")
    if route is not None:
        return getattr(route, "path_format", None) or getattr(route, "path", None) or UNMATCHED
    path = scope.get("path", "")
    return next((label for pattern, label in templates if pattern.fullmatch(path)), UNMATCHED)


def path_templates(paths: Iterable[str]) -> list[tuple[re.Pattern[str], str]]:
    """OpenAPI path templates as regexes: `/v1/models/{model_id}` matches `/v1/models/a/b` too, as the
    `{model_id:path}` route does."""
    return [(re.compile(re.sub(r"\\\{[^/]+?\\\}", ".+", re.escape(p))), p) for p in paths]


@dataclass(slots=True)
class _Sequence:
    first_token_at: float | None = None


@dataclass(slots=True)
class RequestTimer:
    """Latency and token accounting of one `engine_client.generate` call (one or more prompts, n each).

    Call `on_output` for every engine output (before any error handling), and `close` when the iteration
    ends for any reason: sequences that never finished are counted as "abort" (the client left).
    """

    metrics: AppMetrics | None
    started_at: float = field(default_factory=time.perf_counter)
    sequences: dict[tuple[int, int], _Sequence] = field(default_factory=dict)
    unfinished: set[tuple[int, int]] = field(default_factory=set)

    def on_output(self, prompt_index: int, out: RequestOutput) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        key = (prompt_index, out.index)
        seq = self.sequences.get(key)
        if seq is None:
            seq = self.sequences[key] = _Sequence()
            self.unfinished.add(key)
        if out.token_ids:
            self.metrics.generation_tokens.inc(len(out.token_ids))
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.metrics.ttft.observe(now - self.started_at)
        if out.finished:
            self.unfinished.discard(key)
            self._finish(self.metrics, seq, out, now)

    def _finish(self, metrics: AppMetrics, seq: _Sequence, out: RequestOutput, now: float) -> None:
        metrics.finished.labels(out.finish_reason).inc()
        if out.finish_reason in ("abort", "error"):
            return
        metrics.e2e.observe(now - self.started_at)
        if seq.first_token_at is not None and out.completion_tokens > 1:
            metrics.tpot.observe((now - seq.first_token_at) / (out.completion_tokens - 1))

    def close(self) -> None:
        if self.metrics is not None and self.unfinished:
            self.metrics.finished.labels("abort").inc(len(self.unfinished))
            self.unfinished.clear()


def start_timer(prompt_lengths: Iterable[int]) -> RequestTimer:
    """A timer for one engine request, bound to the current app's metrics (a no-op outside a request)."""
    metrics = _current.get()
    if metrics is not None:
        metrics.prompt_tokens.inc(sum(prompt_lengths))
    return RequestTimer(metrics)


class EngineCollector(Collector):
    """Gauges read from `app.state.engine.stats()` at scrape time (nothing while the model loads); with several
    models, from each loaded engine of `app.state.models`, labelled `model`."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def describe(self) -> list[Metric]:
        return []  # values exist only once the engine is attached; no fixed description

    def collect(self) -> Iterator[Metric]:
        registry = getattr(self.app.state, "models", None)  # several models: serving/registry.py
        if registry is not None:
            yield from _registry_metrics(registry)
        engine = getattr(self.app.state, "engine", None)
        if engine is not None:
            yield from _engine_metrics([((), engine.stats())])
        yield _gauge(
            "peregrine_gc_frozen_objects",
            "Python objects moved out of the cyclic collector's reach once the model loaded (gc.freeze).",
            gc.get_freeze_count(),
        )
        admission = getattr(self.app.state, "admission", None)
        if admission is not None:
            yield _gauge(
                "peregrine_http_in_flight",
                "HTTP requests admitted and not yet answered.",
                admission.in_flight,
            )
            yield _counter(
                "peregrine_http_refused",
                "HTTP requests refused by admission control.",
                admission.refused_total,
            )


_ENGINE_SERIES: tuple[tuple[str, str, str, Any], ...] = (
    ("gauge", "peregrine_num_requests_running", "Sequences in the running batch.", lambda s: s.running),
    ("gauge", "peregrine_num_requests_waiting", "Sequences waiting to be scheduled.", lambda s: s.waiting),
    ("gauge", "peregrine_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1).", lambda s: s.kv_usage),
    ("gauge", "peregrine_kv_cache_used_tokens", "KV cache capacity in use, in tokens (blocks x block size).",
     lambda s: s.kv_used_tokens),
    ("gauge", "peregrine_kv_cache_total_tokens", "KV cache capacity, in tokens.", lambda s: s.kv_total_tokens),
    ("counter", "peregrine_preemptions", "Sequences preempted (KV cache full) since start.",
     lambda s: s.preemptions_total),
    ("counter", "peregrine_engine_steps", "Engine steps run since start.", lambda s: s.steps_total),
    ("counter", "peregrine_prefix_cache_queries",
     "Prefix cache queries, in tokens: tokens of the sequences looked up when admitted (vLLM's name).",
     lambda s: s.prefix_cache_queries_total),
    ("counter", "peregrine_prefix_cache_hits",
     "Prefix cache hits, in tokens: tokens whose KV came from the cache instead of being computed.",
     lambda s: s.prefix_cache_hits_total),
    ("gauge", "peregrine_prefix_cache_cached_tokens",
     "KV cache capacity holding reusable prefixes, in tokens (in use or idle; idle ones are evictable).",
     lambda s: s.kv_cached_blocks * s.block_size),
    ("counter", "peregrine_spec_proposed_tokens",
     "Speculative decoding: proposed tokens verified (--speculative; 0 when off).",
     lambda s: s.spec_proposed_tokens_total),
    ("counter", "peregrine_spec_accepted_tokens",
     "Speculative decoding: proposed tokens accepted (each a token gained without a step of its own).",
     lambda s: s.spec_accepted_tokens_total),
    ("gauge", "peregrine_engine_alive", "1 while the engine loop runs, 0 once it died.", lambda s: int(s.alive)),
)  # fmt: skip


def _engine_metrics(rows: list[tuple[tuple[str, ...], Any]], labels: tuple[str, ...] = ()) -> Iterator[Metric]:
    """The engine gauges and counters, one sample per (label values, EngineStats) row: no labels with one
    model, `model` with several (one row per loaded model)."""
    for kind, name, doc, value in _ENGINE_SERIES:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)
        for label_values, stats in rows:
            family.add_metric(list(label_values), value(stats))
        yield family


def _registry_metrics(registry: Any) -> Iterator[Metric]:
    """Per model: loaded or not, loads and unloads so far, and the engine series of each loaded model."""
    slots = list(registry.slots.values())
    loaded = GaugeMetricFamily("peregrine_model_loaded", "1 while the model is loaded, else 0.", labels=["model"])
    loads = CounterMetricFamily("peregrine_model_loads", "Times the model was loaded.", labels=["model"])
    unloads = CounterMetricFamily("peregrine_model_unloads", "Times the model was unloaded.", labels=["model"])
    for slot in slots:
        loaded.add_metric([slot.spec.name], int(slot.state == "loaded"))
        loads.add_metric([slot.spec.name], slot.loads_total)
        unloads.add_metric([slot.spec.name], slot.unloads_total)
    yield from (loaded, loads, unloads)
    rows = [((s.spec.name,), s.engine.stats()) for s in slots if s.engine is not None]
    yield from _engine_metrics(rows, ("model",))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
