"""The engine-only baseline for the server-overhead comparison (`scripts/bench.py --peers engine,peregrine`).

It loads the engine in this process exactly as `main.py` would with the same flags (`config.Settings` ->
`models.acquire.acquire` -> `models.engine_factory.build_async_engine`) and drives the same requests through
`AsyncEngine.generate` directly, with the same concurrency and timing rules as the HTTP client (TTFT at
the first output carrying text, ITL between such outputs). The ratio of Peregrine's HTTP+SSE throughput
to this one is the server's overhead.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from bench_datasets import BenchRequest
from bench_metrics import RequestResult
from bench_peers import REPO


def load_engine(server_args: Sequence[str]) -> Any:
    """An AsyncEngine built from Peregrine's own command-line flags, loop started.

    Like `main.serve`, the engine is built in a helper thread and its loop started from there: which
    thread first runs torch decides how many OpenMP teams exist, and libgomp spins longer at barriers
    when a process has no more OpenMP threads than cores (see docs/benchmarks.md). Mirroring the server
    keeps that difference out of the overhead figure.
    """
    sys.path.insert(0, str(REPO))
    from config import settings_or_exit
    from models.acquire import acquire
    from models.engine_factory import build_async_engine

    settings = settings_or_exit(list(server_args))
    prepared = acquire(settings)
    built: list[Any] = []

    def build() -> None:
        engine = build_async_engine(prepared.engine_config)
        engine.start()
        built.append(engine)

    loader = threading.Thread(target=build, name="bench-engine-loader")
    loader.start()
    loader.join()
    if not built:
        raise RuntimeError("the engine failed to load (see the traceback above)")
    return built[0]


def prompt_ids(engine: Any, req: BenchRequest) -> list[int]:
    """The token ids the server would build for this request (completion text, or the chat template)."""
    tok = engine.tokenizer
    if req.kind == "chat":
        text = tok.apply_chat_template(list(req.messages or ()), add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))
    return list(tok.encode(req.prompt or "", add_special_tokens=False))


async def one_request(engine: Any, ids: list[int], output_len: int,
                      sampling: Sequence[tuple[str, float]] = ()) -> RequestResult:
    from engine.types import SamplingParams

    params = SamplingParams(**{"temperature": 0.0, **dict(sampling)}, max_tokens=output_len, ignore_eos=True)
    result = RequestResult(prompt_tokens=len(ids))
    start = last = time.perf_counter()
    async for out in engine.generate(ids, params, f"bench-{uuid.uuid4().hex}"):
        if out.finish_reason == "error":
            result.error = f"engine error: {out.error}"
            return result
        if out.text:
            now = time.perf_counter()
            if result.success:
                result.itl.append(now - last)
            else:
                result.ttft, result.success = now - start, True
            last = now
        result.output_tokens = out.completion_tokens
    result.latency = time.perf_counter() - start
    return result


async def run_engine_load(
    engine: Any, requests: Sequence[BenchRequest], concurrency: int | None,
    sampling: Sequence[tuple[str, float]] = (),
) -> tuple[list[RequestResult], float]:
    """Like `bench_client.run_load`, without HTTP: at most `concurrency` requests in flight, drawn with
    `sampling` (SamplingParams fields; greedy when empty)."""
    semaphore = asyncio.Semaphore(concurrency or len(requests))
    prepared = [(prompt_ids(engine, r), r.output_len) for r in requests]

    async def one(ids: list[int], n: int) -> RequestResult:
        async with semaphore:
            return await one_request(engine, ids, n, sampling)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(ids, n) for ids, n in prepared))
    return list(results), time.perf_counter() - start
