"""Ollama's keep_alive on the several-models registry, through the real app and routes with stand-in engines (no
model: the registry's FakeEngine of test_model_registry.py): an empty request loads a model, `keep_alive: 0` unloads
it, /api/ps follows, and an unreadable keep_alive is a 400 in Ollama's envelope. The live multi-model server test
(tests/api/test_multi_model.py) does the same with real models."""

from __future__ import annotations

import httpx
import pytest

from app.server import create_app
from config import Settings
from serving.registry import ModelRegistry
from tests.unit.test_model_registry import Loader, spec


@pytest.fixture
def app_and_loader() -> tuple[object, ModelRegistry, Loader]:
    loader = Loader()
    registry = ModelRegistry([spec("a", 100), spec("b", 100)], loader, budget_bytes=1000 * 1_000_000)
    app = create_app(engine=None, settings=Settings())
    app.state.models = registry
    return app, registry, loader


async def test_empty_requests_load_and_unload_and_ps_follows(app_and_loader) -> None:
    app, registry, loader = app_and_loader
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        names = [m["name"] for m in (await http.get("/api/tags")).json()["models"]]
        assert names == ["a", "b"] and (await http.get("/api/ps")).json()["models"] == []
        loaded = (await http.post("/api/generate", json={"model": "b", "stream": False})).json()
        assert loaded["done"] and loaded["done_reason"] == "load" and loader.loaded == ["b"]
        running = (await http.get("/api/ps")).json()["models"]
        assert [m["name"] for m in running] == ["b"] and running[0]["size"] == 100 * 1_000_000
        unloaded = (await http.post("/api/chat", json={"model": "b", "messages": [], "keep_alive": 0})).json()
        assert unloaded["done_reason"] == "unload" and registry.slots["b"].state == "unloaded"
        assert loader.engines["b"].shut_down and (await http.get("/api/ps")).json()["models"] == []
        bad = await http.post("/api/generate", json={"model": "a", "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
        missing = await http.post("/api/generate", json={"model": "zzz"})
        assert missing.status_code == 404 and isinstance(missing.json()["error"], str)


async def test_a_request_keep_alive_sets_the_models_expiry(app_and_loader) -> None:
    app, registry, _ = app_and_loader
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        await http.post("/api/generate", json={"model": "a", "stream": False, "keep_alive": "90s"})
        assert registry.keep_alive_of(registry.slots["a"]) == 90.0
        entry = (await http.get("/api/ps")).json()["models"][0]
        assert entry["name"] == "a" and entry["expires_at"] < "2300"  # not the "forever" date
        await http.post("/api/generate", json={"model": "a", "stream": False, "keep_alive": -1})
        assert (await http.get("/api/ps")).json()["models"][0]["expires_at"].startswith("2318")
