"""The model registry's rules with stand-in engines (no model): routing by name, loading on demand, the wait
limit (503 + Retry-After), keep-alive unloads, per-request keep_alive, the memory budget's evictions and
refusals, and that a model in use is never unloaded. Time is a fake clock; loads block on an event when a test
needs them slow."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from dataclasses import dataclass

import pytest

from app.errors import BadRequestError, NotFoundError
from app.leases import request_keep_alive
from serving.registry import (
    ModelLoadError,
    ModelMemoryError,
    ModelRegistry,
    ModelSpec,
    RetryLaterError,
)

MB = 1_000_000


@dataclass
class FakeStats:
    running: int = 0
    waiting: int = 0
    last_step_age_s: float = 0.0


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.model_name = name
        self.alive = True
        self.busy = 0
        self.shut_down = False

    def stats(self) -> FakeStats:
        return FakeStats(running=self.busy)

    async def shutdown(self) -> None:
        self.shut_down = True
        self.alive = False


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Loader:
    """Builds FakeEngines; `gate` (when set) makes a load wait until the test opens it."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.engines: dict[str, FakeEngine] = {}
        self.gate: threading.Event | None = None
        self.fail: set[str] = set()

    def __call__(self, cfg: str) -> FakeEngine:
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if cfg in self.fail:
            raise RuntimeError(f"no weights for {cfg}")
        self.loaded.append(cfg)
        self.engines[cfg] = FakeEngine(cfg)
        return self.engines[cfg]


def spec(name: str, mb: int, **kw) -> ModelSpec:
    return ModelSpec(name=name, config=name, need_bytes=mb * MB, need_words=f"weights {mb} MB", **kw)


def registry(*specs: ModelSpec, budget_mb: int = 1000, **kw) -> tuple[ModelRegistry, Loader, Clock]:
    loader, clock = Loader(), Clock()
    reg = ModelRegistry(list(specs), loader, budget_mb * MB, clock=clock, **kw)
    return reg, loader, clock


async def test_routes_by_name_and_alias_and_loads_on_demand() -> None:
    reg, loader, _ = registry(spec("a", 100, aliases=("org/a",)), spec("b", 100))
    assert [s.state for s in reg.slots.values()] == ["unloaded", "unloaded"]
    engine, slot = await reg.acquire("b")
    assert engine.model_name == "b" and slot.state == "loaded" and loader.loaded == ["b"]
    engine, slot = await reg.acquire("org/a")
    assert slot.spec.name == "a" and loader.loaded == ["b", "a"]
    engine, slot = await reg.acquire(None)  # no model: the first listed
    assert slot.spec.name == "a" and loader.loaded == ["b", "a"]  # no second load
    with pytest.raises(NotFoundError) as err:
        await reg.acquire("c")
    assert "a, b" in err.value.message and err.value.param == "model"


async def test_a_slow_load_answers_503_with_retry_after_and_goes_on() -> None:
    reg, loader, _ = registry(spec("a", 100), load_wait_s=0.2)
    loader.gate = threading.Event()
    with pytest.raises(RetryLaterError) as err:
        await reg.acquire("a")
    assert err.value.status_code == 503 and err.value.retry_after >= 1 and err.value.code == "model_loading"
    assert reg.slots["a"].state == "loading" and reg.slots["a"].leases == 0
    loader.gate.set()
    await asyncio.wait_for(reg.slots["a"].loading, 30)  # the load went on without the request
    engine, slot = await reg.acquire("a")
    assert slot.state == "loaded" and loader.loaded == ["a"]


async def test_waiting_requests_share_one_load() -> None:
    reg, loader, _ = registry(spec("a", 100))
    loader.gate = threading.Event()
    waiters = [asyncio.ensure_future(reg.acquire("a")) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert reg.slots["a"].leases == 3 and reg.slots["a"].state == "loading"
    loader.gate.set()
    results = await asyncio.gather(*waiters)
    assert {id(engine) for engine, _ in results} == {id(loader.engines["a"])} and loader.loaded == ["a"]


async def test_idle_model_is_unloaded_after_its_keep_alive() -> None:
    reg, loader, clock = registry(spec("a", 100), spec("b", 100, keep_alive_s=5.0), keep_alive_s=60.0)
    _, a = await reg.acquire("a")
    _, b = await reg.acquire("b")
    reg.release(a)
    reg.release(b)
    clock.now += 5.0
    assert await reg.reap() == ["b"]  # b's own keep-alive; a has the server's
    assert b.state == "unloaded" and b.engine is None and loader.engines["b"].shut_down
    clock.now += 55.0
    assert await reg.reap() == ["a"]
    assert (a.unloads_total, b.unloads_total) == (1, 1)


class Cycle:
    """An engine's share of reference cycles: freed by the cyclic collector only."""

    def __init__(self) -> None:
        self.me = self


async def test_an_unload_frees_what_the_load_froze_and_freezes_the_rest_again() -> None:
    """A server freezes what its load left alive (models/engine_factory.freeze_heap); an unload's collection
    unfreezes first, so an unloaded engine's cycles are freed, then freezes what is still alive. With nothing
    frozen (this process otherwise) it stays a plain collection."""
    reg, loader, clock = registry(spec("a", 100), keep_alive_s=5.0)
    engine, a = await reg.acquire("a")
    engine.cycle = Cycle()
    cycle = weakref.ref(engine.cycle)
    reg.release(a)
    del engine, loader.engines["a"]  # the registry's slot holds the engine now, alone
    gc.collect()
    gc.freeze()
    try:
        clock.now += 5.0
        assert await reg.reap() == ["a"]
        assert cycle() is None, "the unloaded engine's frozen cycle was kept"
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    _, a = await reg.acquire("a")
    reg.release(a)
    clock.now += 5.0
    assert await reg.reap() == ["a"] and gc.get_freeze_count() == 0


async def test_a_model_in_use_is_not_unloaded_by_keep_alive() -> None:
    reg, loader, clock = registry(spec("a", 100), keep_alive_s=1.0)
    _, slot = await reg.acquire("a")  # lease held: a response is still streaming
    clock.now += 100
    assert await reg.reap() == []
    reg.release(slot)
    loader.engines["a"].busy = 1  # the engine still has a sequence (e.g. an abort in flight)
    clock.now += 100
    assert await reg.reap() == []
    loader.engines["a"].busy = 0
    assert await reg.reap() == ["a"]


async def test_request_keep_alive_wins_and_negative_means_forever() -> None:
    reg, _, clock = registry(spec("a", 100), keep_alive_s=1.0)
    _, slot = await reg.acquire("a", keep_alive_s=-1.0)
    reg.release(slot)
    clock.now += 10_000
    assert await reg.reap() == [] and reg.expires_in(slot) is None
    _, slot = await reg.acquire("a")  # a request without keep_alive: back to the default (as Ollama)
    reg.release(slot)
    assert reg.expires_in(slot) == 1.0
    _, slot = await reg.acquire("a", keep_alive_s=0.0)  # Ollama's keep_alive 0: unload after this request
    reg.release(slot)
    assert await reg.reap() == ["a"]
    assert request_keep_alive("5m") == 300.0 and request_keep_alive(None) is None
    with pytest.raises(BadRequestError):
        request_keep_alive("soon")


async def test_budget_unloads_the_longest_idle_model_first() -> None:
    reg, loader, clock = registry(spec("a", 400), spec("b", 400), spec("c", 400), budget_mb=900)
    for name in ("a", "b"):
        _, slot = await reg.acquire(name)
        clock.now += 1
        reg.release(slot)
    _, c = await reg.acquire("c")  # 1200 MB > 900: the longest idle (a) makes room
    assert [s.spec.name for s in reg.loaded()] == ["b", "c"] and loader.engines["a"].shut_down


async def test_max_loaded_models_counts_too() -> None:
    reg, _, _ = registry(spec("a", 1), spec("b", 1), max_loaded=1)
    _, a = await reg.acquire("a")
    reg.release(a)
    await reg.acquire("b")
    assert [s.spec.name for s in reg.loaded()] == ["b"]


async def test_budget_refusals_say_why() -> None:
    reg, _, _ = registry(spec("a", 600), spec("b", 600), spec("huge", 5000), budget_mb=1000)
    with pytest.raises(ModelMemoryError) as err:
        await reg.acquire("huge")
    message = err.value.message
    assert "5.0 GB" in message and "1.0 GB" in message and "--models-memory-budget" in message
    assert err.value.status_code == 503 and err.value.code == "model_too_large"
    assert not hasattr(err.value, "retry_after")  # it will never fit: no point retrying
    await reg.acquire("a")  # lease held: a is busy
    with pytest.raises(RetryLaterError) as err:
        await reg.acquire("b")
    assert err.value.code == "memory_budget_busy" and "a 600.0 MB" in err.value.message
    assert reg.slots["b"].state == "unloaded" and reg.slots["b"].leases == 0


async def test_a_model_that_can_never_fit_is_refused_at_once_even_behind_another_load() -> None:
    """The refusal does not wait for the load lock, nor for --model-load-wait (the multi-model API test runs with
    0.001 s, where a busy machine made it answer model_loading instead)."""
    reg, loader, _ = registry(spec("a", 600), spec("huge", 5000), budget_mb=1000, load_wait_s=0.001)
    loader.gate = threading.Event()
    with pytest.raises(RetryLaterError):
        await reg.acquire("a")  # its load holds the lock until the gate opens
    assert reg.slots["a"].state == "loading"
    with pytest.raises(ModelMemoryError) as err:
        await reg.acquire("huge")
    assert err.value.code == "model_too_large" and reg.slots["huge"].loading is None
    assert reg.slots["huge"].state == "unloaded" and reg.slots["huge"].leases == 0
    loader.gate.set()
    await asyncio.wait_for(reg.slots["a"].loading, 30)


async def test_a_failed_load_is_reported_and_retried_next_time() -> None:
    reg, loader, _ = registry(spec("a", 100))
    loader.fail.add("a")
    with pytest.raises(ModelLoadError) as err:
        await reg.acquire("a")
    assert "no weights for a" in err.value.message and reg.slots["a"].state == "unloaded"
    assert reg.slots["a"].last_error and reg.slots["a"].leases == 0
    loader.fail.clear()
    _, slot = await reg.acquire("a")
    assert slot.state == "loaded" and slot.last_error is None


async def test_a_dead_engine_is_replaced_on_the_next_request() -> None:
    reg, loader, _ = registry(spec("a", 100))
    engine, slot = await reg.acquire("a")
    reg.release(slot)
    engine.alive = False  # its loop died
    fresh, slot = await reg.acquire("a")
    assert fresh is not engine and fresh.alive and slot.loads_total == 2 and engine.shut_down


async def test_start_preloads_the_default_and_close_unloads_all() -> None:
    reg, loader, _ = registry(spec("a", 100), spec("b", 100))
    await reg.start()
    await asyncio.wait_for(reg.slots["a"].loading, 30)
    assert loader.loaded == ["a"] and reg.slots["b"].state == "unloaded"
    await reg.close()
    assert reg.loaded() == [] and loader.engines["a"].shut_down


async def test_a_model_taken_while_another_unloads_is_kept() -> None:
    """Unloads await an engine's shutdown; a request that takes the next expired model meanwhile keeps it."""
    reg, loader, clock = registry(spec("a", 100), spec("b", 100), keep_alive_s=1.0)
    for name in ("a", "b"):
        _, slot = await reg.acquire(name)
        reg.release(slot)
    clock.now += 10
    shutting = asyncio.Event()
    finish = asyncio.Event()
    engine_a = loader.engines["a"]

    async def slow_shutdown() -> None:
        shutting.set()
        await finish.wait()
        engine_a.alive = False

    engine_a.shutdown = slow_shutdown
    reaping = asyncio.ensure_future(reg.reap())
    await shutting.wait()
    engine_b, slot_b = await reg.acquire("b")  # b was expired too, but now it is in use
    finish.set()
    assert await reaping == ["a"]
    assert slot_b.state == "loaded" and engine_b.alive and reg.slots["b"].engine is engine_b
    reg.release(slot_b)
