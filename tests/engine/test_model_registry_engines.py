"""Real engines in the model registry (the tiny random model, twice): unloading stops the engine's loop
thread and frees the engine, its weights and its KV cache (nothing keeps a reference), and loading it again
gives a working engine."""

from __future__ import annotations

import gc
import threading
import weakref

from engine.types import EngineConfig, SamplingParams
from serving.registry import ModelRegistry, ModelSpec
from serving.start import start_engine
from tests.support import chat_ids


def _config(path, name: str) -> EngineConfig:
    return EngineConfig(model_path=str(path), model_name=name, device="cpu", dtype="float32",
                        kv_cache_bytes=2 << 20, max_num_seqs=4, max_num_batched_tokens=64, cpu_kernels=False)  # fmt: skip


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "peregrine-engine"]


async def _answer(engine, request_id: str) -> list[int]:
    ids = chat_ids(engine.tokenizer, "hello")
    tokens: list[int] = []
    async for out in engine.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), request_id):
        tokens += out.token_ids
    return tokens


async def test_unload_leaves_no_engine_kv_or_thread_behind(tiny_model_dir) -> None:
    threads_before = len(_engine_threads())
    specs = [ModelSpec(name, _config(tiny_model_dir.path, name), 1_000_000, "tiny") for name in ("one", "two")]
    registry = ModelRegistry(specs, start_engine, budget_bytes=10_000_000)
    engine, slot = await registry.acquire("one")
    other, other_slot = await registry.acquire("two")
    first = await _answer(engine, "a")
    assert first == await _answer(other, "b")  # same weights, separate engines: same greedy answer
    registry.release(slot)
    registry.release(other_slot)
    assert len(_engine_threads()) == threads_before + 2

    loop_thread, refs = engine._thread, [weakref.ref(engine), weakref.ref(engine.engine),
                                         weakref.ref(engine.engine.kv_cache)]  # fmt: skip
    del engine
    await registry.unload("one")
    gc.collect()
    assert not loop_thread.is_alive()
    assert [r() for r in refs] == [None, None, None], "the unloaded engine (or its KV cache) is still referenced"
    assert len(_engine_threads()) == threads_before + 1 and other.stats().alive  # the other model is untouched

    again, slot = await registry.acquire("one")
    assert await _answer(again, "c") == first and slot.loads_total == 2
    registry.release(slot)
    del again, other
    await registry.close()
    assert len(_engine_threads()) == threads_before
