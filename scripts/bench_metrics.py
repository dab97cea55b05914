"""Serving-benchmark arithmetic, as vLLM's `benchmark_serving.py` defines it. Pure Python, no I/O.

Per request (one streamed completion):
- TTFT: from sending the request to the first chunk that carries generated text.
- ITL: the gaps between successive text chunks after the first (one entry per gap).
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2EL: from sending the request to the end of the stream.
Per run: requests/s, output tokens/s and total (prompt + output) tokens/s over the run's duration (first
send to last completion), and mean / p50 / p90 / p99 (plus std) of each latency, in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """The timings of one request, in seconds since it was sent (all filled by the client)."""

    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean, std, p50, p90, p99 of durations given in seconds, reported in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        return {"mean": 0.0, "std": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return {"mean": mean, "std": std, **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One load level against one server."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    errors: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["errors"] = list(self.errors)
        return data


def summarize(results: Sequence[RequestResult], duration_s: float, max_errors: int = 5) -> RunSummary:
    """Aggregate a run's request results; failed requests count only in `failed` (and `errors`)."""
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    errors = tuple(dict.fromkeys(r.error for r in results if not r.success))[:max_errors]
    return RunSummary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(prompt_tokens + output_tokens) * per_s,
        ttft_ms=describe_ms([r.ttft for r in ok]),
        tpot_ms=describe_ms(tpots),
        itl_ms=describe_ms([gap for r in ok for gap in r.itl]),
        e2el_ms=describe_ms([r.latency for r in ok]),
        errors=errors,
    )


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is 0 (a peer that produced nothing)."""
    return numerator / denominator if denominator else None
