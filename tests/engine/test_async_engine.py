"""The async front: streaming, concurrency, abort and cancellation, loop death, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine import AsyncEngine, EngineConfig, EngineDeadError, RequestOutput, SamplingParams
from tests.support import make_engine, run_all, text_of, tokens_of

pytestmark = pytest.mark.timeout(300)


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
async def front(tiny: Any) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(tiny, max_num_batched_tokens=32), "tiny")
    engine.start()
    yield engine
    await engine.shutdown()
    assert engine.engine.blocks.num_used_blocks == 0


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]


async def wait_for(condition: Any, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class StepGate:
    """Holds the engine's loop thread before its step number `after` + 1 until `release()`: while held, a
    request is provably still in flight, however fast the machine generates (no race with generation)."""

    def __init__(self, front: AsyncEngine, after: int) -> None:
        self.after, self.steps = after, 0
        self.holding, self._open = threading.Event(), threading.Event()
        self._step = front.engine.step
        front.engine.step = self.step  # type: ignore[method-assign]

    def step(self) -> list[RequestOutput]:
        if self.steps >= self.after:
            self.holding.set()
            assert self._open.wait(120), "the test never released the engine"
        self.steps += 1
        return self._step()

    async def held(self) -> None:
        assert await asyncio.to_thread(self.holding.wait, 120), "the engine never reached the gate"

    def release(self) -> None:
        self._open.set()


async def test_streams_the_same_tokens_as_the_sync_engine(front: AsyncEngine, tiny: Any) -> None:
    prompt = tiny.tokenizer.encode("Hello world")
    expected = run_all(make_engine(tiny), {"s": (prompt, greedy())})["s"]
    outs = await collect(front, prompt, greedy(), "a")
    assert len(outs) == 16 and all(len(o.token_ids) == 1 for o in outs)
    assert tokens_of(outs) == tokens_of(expected) and text_of(outs) == text_of(expected)
    assert [o.finished for o in outs] == [False] * 15 + [True]
    assert outs[-1].completion_tokens == 16 and outs[-1].prompt_tokens == len(prompt)


async def test_concurrent_requests_and_n(front: AsyncEngine, tiny: Any) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in ["Hello world", "def add(a, b):", "Numbers: 0 1 2"]]
    expected = [tokens_of(run_all(make_engine(tiny), {"s": (p, greedy())})["s"]) for p in prompts]
    results = await asyncio.gather(*(collect(front, p, greedy(), f"r{i}") for i, p in enumerate(prompts)))
    assert [tokens_of(r) for r in results] == expected
    many = await collect(front, prompts[0], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8,
                                                            ignore_eos=True), "n")
    assert sorted(o.index for o in many if o.finished) == [0, 1]
    assert len(tokens_of(many, 0)) == len(tokens_of(many, 1)) == 8


async def test_abort_mid_generation_ends_stream_and_frees_kv(front: AsyncEngine, tiny: Any) -> None:
    gate = StepGate(front, after=3)  # the abort lands while the request has ~400 tokens to go
    outs = []
    async for out in front.generate(tiny.tokenizer.encode("Hello"), greedy(400), "long"):
        outs.append(out)
        if len(outs) == 3:
            await gate.held()
            assert front.stats().kv_used_blocks > 0
            front.abort("long")
            gate.release()
    # three tokens, the held step's token, then the abort, applied before the step after it
    assert outs[-1].finish_reason == "abort" and len(outs) <= 5
    assert front.stats().kv_used_blocks == 0  # freed in the step that processed the abort
    front.abort("no-such-request")  # harmless


async def test_cancelled_consumer_aborts_its_request(front: AsyncEngine, tiny: Any) -> None:
    gate = StepGate(front, after=1)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in front.generate(tiny.tokenizer.encode("Hello"), greedy(400), "gone"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 60)
    await gate.held()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.release()
    await wait_for(lambda: front.stats().running == 0 and front.stats().kv_used_blocks == 0)
    assert front.stats().generated_tokens_total < 400  # aborted, not run to the end


async def test_event_loop_keeps_running_during_generation(front: AsyncEngine, tiny: Any) -> None:
    """The engine steps in its own thread: while a step is held there, the event loop still runs other work
    (were the step on the loop's thread, the ticker could never reach 100 and the gate would time out)."""
    gate = StepGate(front, after=1)
    ticked = threading.Event()

    async def ticker() -> None:
        await gate.held()
        for _ in range(100):
            await asyncio.sleep(0)
        ticked.set()
        gate.release()

    task = asyncio.create_task(ticker())
    outs = await collect(front, tiny.tokenizer.encode("Hello"), greedy(32), "t")
    await task
    assert ticked.is_set() and len(outs) == 32


async def test_loop_death_fails_in_flight_requests_then_refuses(front: AsyncEngine, tiny: Any) -> None:
    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("device fell off the bus")

    front.engine.step = broken_step  # type: ignore[method-assign]
    outs = await collect(front, tiny.tokenizer.encode("Hello"), SamplingParams(n=2, max_tokens=4), "x")
    assert sorted(o.index for o in outs) == [0, 1]
    assert all(o.finish_reason == "error" and "device fell off the bus" in (o.error or "") for o in outs)
    assert front.stats().alive is False
    with pytest.raises(EngineDeadError):
        await collect(front, tiny.tokenizer.encode("Hello"), greedy(), "y")
    front.engine.abort_all()  # the dead loop left its sequence behind; release it for the teardown check


async def test_shutdown_aborts_in_flight_requests(tiny: Any) -> None:
    engine = AsyncEngine(make_engine(tiny), "tiny")
    first = asyncio.Event()
    outs: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate(tiny.tokenizer.encode("Hello"), greedy(400), "s"):
            outs.append(out)
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 60)
    await engine.shutdown()
    await asyncio.wait_for(task, 60)
    assert outs[-1].finish_reason == "abort"
    assert engine.stats().kv_used_blocks == 0 and not engine.stats().alive


async def test_from_config_loads_a_model_folder(tiny_model_dir: Any, tiny: Any) -> None:
    from models.engine_factory import build_async_engine

    cfg = EngineConfig(model_path=str(tiny_model_dir.path), model_name="tiny-llama", device="cpu",
                       dtype="float32", kv_cache_bytes=1 << 20)
    engine = build_async_engine(cfg)
    assert (engine.model_name, engine.device, engine.dtype) == ("tiny-llama", "cpu", "float32")
    assert engine.vocab_size == len(tiny.tokenizer) and engine.max_model_len <= 512
    try:
        outs = await collect(engine, engine.tokenizer.encode("Hello"), greedy(4), "c")
        assert len(tokens_of(outs)) == 4
        stats = engine.stats()
        assert stats.generated_tokens_total == 4 and stats.kv_used_blocks == 0 and stats.kv_total_blocks > 0
    finally:
        await engine.shutdown()


async def test_a_step_waits_until_the_loop_has_taken_the_last_steps_tokens(tiny: Any) -> None:
    """Hand-off on: each step starts only after the consumer has received every earlier output."""
    front = AsyncEngine(make_engine(tiny), "tiny", hand_off_s=120.0)
    received: list[RequestOutput] = []
    seen_at_step: list[tuple[int, int]] = []  # (outputs the consumer had, outputs emitted) when a step began
    emitted = [0]
    step = front.engine.step

    def watched_step() -> list[RequestOutput]:
        seen_at_step.append((len(received), emitted[0]))
        outs = step()
        emitted[0] += len(outs)
        return outs

    front.engine.step = watched_step  # type: ignore[method-assign]
    try:
        async for out in front.generate(tiny.tokenizer.encode("Hello"), greedy(24), "h"):
            received.append(out)
    finally:
        await front.shutdown()
    assert len(received) == 24 and len(seen_at_step) >= 24
    assert all(had == sent for had, sent in seen_at_step), seen_at_step


@pytest.mark.parametrize(("hand_off_s", "steps_while_blocked"), [(120.0, (0, 2)), (0.01, (5, 10**6)), (0.0, (5, 10**6))])
async def test_a_blocked_event_loop_holds_steps_only_up_to_the_hand_off_limit(
    tiny: Any, hand_off_s: float, steps_while_blocked: tuple[int, int]
) -> None:
    """With the loop blocked for a second: a long hand-off holds the engine (at most the step in flight and
    one more finish), a short one or none lets it go on stepping."""
    front = AsyncEngine(make_engine(tiny), "tiny", hand_off_s=hand_off_s)
    stream = front.generate(tiny.tokenizer.encode("Hello"), greedy(500), "b")
    try:
        await anext(stream)
        before = front.engine.counters.steps
        time.sleep(1.0)  # blocks the event loop on purpose: no consumer runs
        during = front.engine.counters.steps - before
        low, high = steps_while_blocked
        assert low <= during <= high, during
    finally:
        await stream.aclose()
        await front.shutdown()


def test_the_hand_off_is_on_where_the_engine_threads_take_every_cpu() -> None:
    import os

    import torch

    from engine.backends.cpu import CpuBackend
    from engine.backends.cuda import CudaBackend
    from engine.backends.kernels import KernelOptions
    from engine.backends.tt import TTBackend

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = CpuBackend(torch.device("cpu"), KernelOptions(False, None))
    assert cpu.team_fills_cpus() == (torch.get_num_threads() >= cpus)
    assert not object.__new__(CudaBackend).team_fills_cpus() and not object.__new__(TTBackend).team_fills_cpus()
