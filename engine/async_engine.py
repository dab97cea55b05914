"""The async front: per-request queues over one synchronous step loop running in its own thread.

One producer (the loop thread) and one queue per request. The event loop only enqueues commands (add, abort)
and awaits its queue, so a slow step never blocks it. A consumer that goes away (cancelled, closed) aborts its
request, which frees its KV blocks at the start of the next step.

Hand-off: on a CPU where the engine's threads take every core this process may use, the loop thread waits after
each step (up to HAND_OFF_WAIT_S) until the event loops it delivered to have run the consumers it woke, so that
streaming a token (JSON, SSE framing, the socket write: ~0.2-0.3 ms a token in Peregrine's server) does not take
a core from the next step's thread team, whose barriers would then wait for the preempted thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.llm_engine import LLMEngine
from engine.sampling import grammar
from engine.types import (
    EngineDeadError,
    EngineError,
    EngineStats,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
HAND_OFF_WAIT_S = 0.005  # the longest a step waits for the event loop to take the last step's outputs


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[RequestOutput]]
    remaining: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str, hand_off_s: float | None = None) -> None:
        """hand_off_s: how long a step may wait for the event loop to take the last step's outputs (module
        docstring); None: HAND_OFF_WAIT_S where the engine's threads take every CPU, else 0 (no wait)."""
        self.engine = engine
        self.hand_off_s = (HAND_OFF_WAIT_S if engine.backend.team_fills_cpus() else 0.0) if hand_off_s is None \
            else hand_off_s
        if self.hand_off_s:
            log.info("each step waits up to %.0f ms for the event loop to stream the last one's tokens: the "
                     "engine's %d threads take every CPU this process may use", self.hand_off_s * 1e3,
                     torch.get_num_threads())
        self.model_name = model_name
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._alive = True
        self._last_step_end = time.monotonic()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def device(self) -> str:
        return str(self.engine.device)

    @property
    def dtype(self) -> str:
        return str(self.engine.dtype).removeprefix("torch.")

    @property
    def alive(self) -> bool:
        return self._alive

    def start(self) -> None:
        with self._lock:
            if self._thread is None and self._alive:
                self._thread = threading.Thread(target=self._run, name="peregrine-engine", daemon=True)
                self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._alive = False

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; the iterator ends when all `params.n` sequences have finished.

        The prompt and the params are checked here, when called, and only here: a prompt that does not fit raises
        PromptTooLongError (a bad one InvalidRequestError) before any output, so the caller can still answer 400.
        The request is queued when iteration starts; closing the iterator early aborts it."""
        if not self._alive:
            raise EngineDeadError("the engine loop has stopped")
        self.engine.validate(prompt_token_ids, params)
        return self._stream(prompt_token_ids, params, request_id)

    async def _stream(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """A constrained request's grammar is compiled here, in a worker thread, unless the app's
        `grammar.validate` already did (then it is cached): the engine loop never compiles."""
        if params.constraint is not None:
            try:
                await asyncio.to_thread(grammar.validate, params.constraint, self.tokenizer)
            except grammar.GrammarError as exc:
                raise InvalidRequestError(exc.message, param="constraint") from None
        stream = self._open(prompt_token_ids, params, request_id)
        try:
            while stream.remaining:
                for out in await stream.queue.get():
                    if out.finished:
                        stream.remaining.discard(out.index)
                    yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if stream.remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    def stats(self) -> EngineStats:
        busy = self.engine.has_work
        age = time.monotonic() - self._last_step_end if busy or not self._alive else 0.0
        return self.engine.stats(last_step_age_s=age, alive=self._alive)

    def _open(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> _Stream:
        if not self._alive:
            raise EngineDeadError("the engine loop has stopped")
        self.start()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), set(range(params.n)))
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
            self._streams[request_id] = stream
        self._submit(_Add(request_id, list(prompt_token_ids), params))
        return stream

    def _submit(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                self._apply_commands()
                if not self.engine.has_work:
                    self._wake.wait(IDLE_WAIT_S)
                    self._last_step_end = time.monotonic()  # idle is healthy: the stall clock starts at new work
                    continue
                outputs = self.engine.step()
                self._last_step_end = time.monotonic()
                self._hand_off(self._dispatch(outputs))
            self._dispatch(self._drain_as_aborted() + self.engine.abort_all())
        except BaseException as exc:  # the loop is dead: every waiter must hear about it
            log.exception("engine loop died")
            self._alive = False
            self._fail_all(f"engine loop died: {type(exc).__name__}: {exc}")
        finally:
            self._alive = False

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._dispatch(self.engine.abort_request(command.request_id))

    def _add(self, command: _Add) -> None:
        try:
            self.engine.admit(command.request_id, command.prompt_token_ids, command.params)
        except EngineError as exc:  # validated by `generate`; this guards the loop (a grammar that fails), not the caller
            self._dispatch([RequestOutput(command.request_id, i, "", [], len(command.prompt_token_ids), 0,
                                          finish_reason="error", error=str(exc)) for i in range(command.params.n)])

    def _drain_as_aborted(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return outs
            if isinstance(command, _Add):
                n = len(command.prompt_token_ids)
                outs += [RequestOutput(command.request_id, i, "", [], n, 0, finish_reason="abort")
                         for i in range(command.params.n)]

    def _dispatch(self, outputs: list[RequestOutput]) -> set[asyncio.AbstractEventLoop]:
        """Deliver each request's outputs to its queue; returns the event loops delivered to."""
        by_request: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
        with self._lock:
            targets = [(self._streams.get(rid), outs) for rid, outs in by_request.items()]
        loops = set()
        for stream, outs in targets:
            if stream is not None:
                _deliver(stream, outs)
                loops.add(stream.loop)
        return loops

    def _hand_off(self, loops: set[asyncio.AbstractEventLoop]) -> None:
        """Wait, up to `hand_off_s`, until each loop has run the consumers this step's outputs woke: a callback
        queued behind the deliveries queues a second one, which runs after the tasks those deliveries woke."""
        if not self.hand_off_s or not loops:
            return
        taken = []
        for loop in loops:
            event = threading.Event()
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody to wait for
                loop.call_soon_threadsafe(loop.call_soon, event.set)
                taken.append(event)
        deadline = time.monotonic() + self.hand_off_s
        for event in taken:
            event.wait(max(0.0, deadline - time.monotonic()))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams = dict(self._streams)
        for rid, stream in streams.items():
            outs = [RequestOutput(rid, i, "", [], 0, 0, finish_reason="error", error=message)
                    for i in sorted(stream.remaining)]
            _deliver(stream, outs)


def _deliver(stream: _Stream, outs: list[RequestOutput]) -> None:
    with contextlib.suppress(RuntimeError):  # the consumer's event loop is closed: nobody is listening
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, outs)
