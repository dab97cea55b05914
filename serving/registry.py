"""Several models in one server, like Ollama: each its own engine, loaded on demand, unloaded when idle.

`ModelRegistry` is what the routes ask for "the engine of the request's model" when the server was started with
more than one model (`app.state.models`; with one model `app.state.engine` is used as before). It knows every
served model (`ModelSpec`: names, the preflight memory arithmetic, the engine config) and keeps one `ModelSlot`
per model with its state: "unloaded", "loading", "loaded" or "unloading".

- **On demand.** `acquire` returns a loaded engine, starting its load if needed. Loads run one at a time in a
  worker thread; a request waits for its model up to `load_wait_s`, then gets 503 with `Retry-After` (the load
  goes on, so the retry finds the model loaded).
- **Memory budget.** Before a load, the models loaded must leave room for the new one's preflight need
  (weights + KV cache, `models/preflight.py`). The loaded models idle longest are unloaded first; a model in
  use is never unloaded. A model that can never fit, or cannot fit while the others are busy, is refused with
  the arithmetic in the message.
- **Keep-alive.** A model with no request in flight for longer than its keep-alive (the request's
  `keep_alive`, else the model's, else the server's `--model-keep-alive`; negative: forever) is unloaded by
  `reap`, which a background task runs every second.
- **Leases.** Each request holds a lease on its model from `acquire` until its response is complete (streams
  included): `app/leases.py`'s `ModelLeaseMiddleware` releases it, so neither keep-alive nor eviction unloads a
  model mid-answer. The routes know the registry only as `app.leases.ModelRouter`: `serving/` imports the app
  (its typed errors, the `Engine` seam), never the other way round.

Unloading shuts the engine's loop thread down and drops every reference to the engine, so its weights and KV
cache are freed. No fastapi in here except the request-scoped lease list; errors are the app's typed errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from app.errors import APIError, ServiceUnavailableError, model_not_found
from models.preflight import fmt_bytes

if TYPE_CHECKING:
    from app.deps import Engine

log = logging.getLogger("peregrine.models")

ModelState = Literal["unloaded", "loading", "loaded", "unloading"]
REAP_INTERVAL_S = 1.0
FIRST_LOAD_GUESS_S = 10.0  # Retry-After for a model never loaded before


class ModelMemoryError(ServiceUnavailableError):
    """The memory budget cannot make room for the model (now, or ever: then no Retry-After)."""


class ModelLoadError(APIError):
    """Loading the model failed (the server log has the traceback)."""

    status_code = 500
    error_type = "internal_server_error"


class RetryLaterError(ServiceUnavailableError):
    """A 503 that tells the client when to come back (`retry_after` seconds, sent as Retry-After)."""

    def __init__(self, message: str, *, retry_after: int, code: str) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


@dataclass(frozen=True)
class ModelSpec:
    """One servable model. `need_bytes` is the preflight arithmetic: weights + KV cache (+ packed copy)."""

    name: str
    config: Any  # what `load` is given (engine.types.EngineConfig)
    need_bytes: int
    need_words: str  # "weights 0.5 GB in float32 + KV cache 0.3 GB"
    aliases: tuple[str, ...] = ()
    keep_alive_s: float | None = None  # None: the server's
    max_model_len: int | None = None  # shown before the model is loaded


@dataclass
class ModelSlot:
    spec: ModelSpec
    engine: Engine | None = None
    state: ModelState = "unloaded"
    leases: int = 0
    last_used: float = 0.0
    keep_alive_s: float | None = None  # the latest request's keep_alive (None: it gave none)
    loading: asyncio.Task | None = None
    load_started: float = 0.0
    last_load_s: float | None = None
    loads_total: int = 0
    unloads_total: int = 0
    last_error: str | None = None

    @property
    def busy(self) -> bool:
        """In use: a lease is held, or the engine still has sequences (never unload then)."""
        if self.leases > 0:
            return True
        if self.engine is None:
            return False
        stats = self.engine.stats()
        return stats.running + stats.waiting > 0


@dataclass
class ModelRegistry:
    specs: Sequence[ModelSpec]
    load: Callable[[Any], Any]  # blocking: engine config -> started AsyncEngine (run in a worker thread)
    budget_bytes: int
    keep_alive_s: float = 300.0
    load_wait_s: float = 60.0
    max_loaded: int = 0  # 0: as many as the budget allows
    clock: Callable[[], float] = time.monotonic
    slots: dict[str, ModelSlot] = field(init=False)
    _names: dict[str, str] = field(init=False)
    _load_lock: asyncio.Lock | None = field(init=False, default=None)
    _reaper: asyncio.Task | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.slots = {s.name: ModelSlot(s) for s in self.specs}
        self._names = {}
        for spec in self.specs:
            for alias in (*spec.aliases, spec.name):
                self._names[alias] = spec.name  # served names win over aliases

    # --- what the routes call --------------------------------------------------------------------------

    @property
    def default(self) -> str:
        return self.specs[0].name

    def slot(self, model: str | None) -> ModelSlot:
        """The model a request names (None: the default); 404 in the OpenAI envelope for any other name."""
        name = self._names.get(model if model is not None else self.default)
        if name is None:
            raise model_not_found(str(model), list(self.slots))
        return self.slots[name]

    async def acquire(self, model: str | None, keep_alive_s: float | None = None) -> tuple[Any, ModelSlot]:
        """The loaded engine of `model` and its slot, with a lease taken (give it back with `release`)."""
        slot = self.slot(model)
        slot.leases += 1
        try:
            if slot.engine is None or not slot.engine.alive:
                await self._wait_loaded(slot)
        except BaseException:
            slot.leases -= 1
            raise
        slot.keep_alive_s = keep_alive_s  # as Ollama: the latest request's keep_alive, or the default
        slot.last_used = self.clock()
        return slot.engine, slot

    def release(self, slot: ModelSlot) -> None:
        slot.leases -= 1
        slot.last_used = self.clock()

    def loaded(self) -> list[ModelSlot]:
        return [s for s in self.slots.values() if s.engine is not None]

    # --- loading ---------------------------------------------------------------------------------------

    async def _wait_loaded(self, slot: ModelSlot) -> None:
        self._refuse_if_never_fits(slot)  # at once: not after --model-load-wait, nor behind another model's load
        if slot.loading is None or slot.loading.done():
            slot.loading = asyncio.ensure_future(self._load(slot))
            slot.loading.add_done_callback(_retrieve)
        try:
            await asyncio.wait_for(asyncio.shield(slot.loading), timeout=self.load_wait_s)
        except TimeoutError:
            raise RetryLaterError(
                f"The model '{slot.spec.name}' is still loading (waited {self.load_wait_s:g} s, "
                "--model-load-wait); retry shortly.",
                retry_after=self._retry_after(slot), code="model_loading",
            ) from None  # fmt: skip

    def _retry_after(self, slot: ModelSlot) -> int:
        expected = slot.last_load_s or FIRST_LOAD_GUESS_S
        return max(1, math.ceil(expected - (self.clock() - slot.load_started)))

    async def _load(self, slot: ModelSlot) -> None:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        async with self._load_lock:  # one load at a time: the budget arithmetic and the CPU both need it
            if slot.engine is not None and slot.engine.alive:
                return
            if slot.engine is not None:  # its loop died: replace it
                await self._unload(slot, "its engine loop stopped")
            await self._make_room(slot)
            slot.state, slot.load_started = "loading", self.clock()
            log.info("loading model %s (%s)", slot.spec.name, slot.spec.need_words)
            try:
                engine = await asyncio.to_thread(self.load, slot.spec.config)
            except Exception as exc:
                slot.state, slot.last_error = "unloaded", f"{type(exc).__name__}: {exc}"
                log.exception("loading model %s failed", slot.spec.name)
                raise ModelLoadError(f"Loading the model '{slot.spec.name}' failed: {exc}",
                                     code="model_load_failed") from None  # fmt: skip
            slot.engine, slot.state, slot.last_error = engine, "loaded", None
            slot.last_load_s = self.clock() - slot.load_started
            slot.loads_total += 1
            slot.last_used = self.clock()
            log.info("model %s loaded in %.1f s", slot.spec.name, slot.last_load_s)

    def _used_bytes(self) -> int:
        return sum(s.spec.need_bytes for s in self.slots.values() if s.state in ("loaded", "loading"))

    def _refuse_if_never_fits(self, slot: ModelSlot) -> None:
        need = slot.spec.need_bytes
        if need > self.budget_bytes:
            raise ModelMemoryError(
                f"The model '{slot.spec.name}' needs {fmt_bytes(need)} ({slot.spec.need_words}), more than the "
                f"whole memory budget of {fmt_bytes(self.budget_bytes)} (--models-memory-budget): it cannot be "
                "loaded.", code="model_too_large",
            )  # fmt: skip

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload idle models, longest idle first, until `slot` fits the budget and the model count."""
        self._refuse_if_never_fits(slot)
        need = slot.spec.need_bytes
        idle = sorted((s for s in self.loaded() if s is not slot and not s.busy), key=lambda s: s.last_used)
        while not self._fits(need) and idle:
            victim = idle.pop(0)
            if not victim.busy:  # checked again: a request may have taken it while an earlier unload ran
                await self._unload(victim, f"to make room for {slot.spec.name}")
        if not self._fits(need):
            busy = ", ".join(f"{s.spec.name} {fmt_bytes(s.spec.need_bytes)}" for s in self.loaded())
            raise RetryLaterError(
                f"The model '{slot.spec.name}' needs {fmt_bytes(need)} ({slot.spec.need_words}); "
                f"{fmt_bytes(self.budget_bytes - self._used_bytes())} of the {fmt_bytes(self.budget_bytes)} "
                f"memory budget is free and the loaded models are serving requests ({busy}). Retry when they "
                "finish.", retry_after=1, code="memory_budget_busy",
            )  # fmt: skip

    def _fits(self, need: int) -> bool:
        count_ok = self.max_loaded <= 0 or len(self.loaded()) < self.max_loaded
        return count_ok and self._used_bytes() + need <= self.budget_bytes

    # --- unloading -------------------------------------------------------------------------------------

    def keep_alive_of(self, slot: ModelSlot) -> float:
        for value in (slot.keep_alive_s, slot.spec.keep_alive_s):
            if value is not None:
                return value
        return self.keep_alive_s

    def expires_in(self, slot: ModelSlot) -> float | None:
        """Seconds until keep-alive unloads the model (None: loaded for good, busy, or not loaded)."""
        keep = self.keep_alive_of(slot)
        if slot.state != "loaded" or keep < 0 or slot.leases > 0:
            return None
        return max(0.0, slot.last_used + keep - self.clock())

    async def reap(self) -> list[str]:
        """Unload every model idle past its keep-alive; returns their names."""
        unloaded = []
        for slot in self.loaded():
            # checked one model at a time: a request may take a model while an earlier unload runs
            if slot.state == "loaded" and self.expires_in(slot) == 0.0 and not slot.busy:
                await self._unload(slot, f"idle for {self.keep_alive_of(slot):g} s (keep_alive)")
                unloaded.append(slot.spec.name)
        return unloaded

    async def unload(self, model: str) -> None:
        await self._unload(self.slot(model), "asked to")

    async def _unload(self, slot: ModelSlot, why: str) -> None:
        engine, slot.engine = slot.engine, None
        if engine is None:
            return
        slot.state = "unloading"
        try:
            await engine.shutdown()
        finally:
            del engine
            await asyncio.to_thread(_collect)  # the weights and KV cache go now, not at some later collection
            slot.state, slot.keep_alive_s = "unloaded", None
            slot.unloads_total += 1
            log.info("model %s unloaded: %s", slot.spec.name, why)

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self, preload: bool = True) -> None:
        """Start the keep-alive task; load the default model in the background (at server start)."""
        if self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap_forever())
        if preload:
            slot = self.slots[self.default]
            slot.loading = asyncio.ensure_future(self._load(slot))
            slot.loading.add_done_callback(_retrieve)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - keep reaping; the next round may succeed
                log.exception("unloading idle models failed")

    async def close(self) -> None:
        """Stop the keep-alive task and every engine (server shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for slot in self.loaded():
            await self._unload(slot, "the server is stopping")

    def describe(self, slot: ModelSlot) -> dict[str, Any]:
        """What /v1/models and /health say about one model."""
        expires = self.expires_in(slot)
        return {
            "state": slot.state,
            "memory_bytes": slot.spec.need_bytes,
            "keep_alive_s": self.keep_alive_of(slot),
            "expires_in_s": None if expires is None else round(expires, 1),
            "in_flight": slot.leases,
            "loads_total": slot.loads_total,
            "unloads_total": slot.unloads_total,
            "last_error": slot.last_error,
        }


def _retrieve(task: asyncio.Task) -> None:
    """Read a background load's exception (a waiting request reports it), so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


def install_registry(app: Any, registry: ModelRegistry, preload: bool = True) -> None:
    """Serve several models: routes find `registry` at `app.state.models`; it starts (keep-alive task, the
    default model loading) with the server and unloads every model when the server stops."""
    app.state.models = registry
    outer = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(asgi_app: Any) -> AsyncIterator[Any]:
        async with outer(asgi_app) as state:
            await registry.start(preload=preload)
            try:
                yield state
            finally:
                await registry.close()

    app.router.lifespan_context = lifespan


def _collect() -> None:
    """A full collection that reaches the objects a load froze (models/engine_factory.freeze_heap: an unloaded
    model's cycles among them), then what is still alive frozen again; a plain one where nothing is frozen."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
