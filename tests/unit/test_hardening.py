"""install_hardening's wiring, the start-up warnings, and the draining uvicorn server (no model)."""

from __future__ import annotations

import asyncio
import logging
import signal
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr

from app.auth import mint_token
from app.hardening import DrainingServer, exposure_warnings, install_hardening, is_loopback

SECRET = "hardening-unit-test-secret-0123456789abcdef"


def settings(**overrides) -> SimpleNamespace:
    base = {
        "host": "127.0.0.1",
        "api_key_list": (),
        "jwt_secret": None,
        "max_num_seqs": 1,
        "max_queue": 1,
        "max_body_bytes": 256,
        "request_timeout": 600.0,
        "rate_limit_per_s": 0.0,
        "rate_limit_burst": 0,
    }
    return SimpleNamespace(**(base | overrides))


def build(s: SimpleNamespace) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"ok": True}

    install_hardening(app, s)
    return app


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.org", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_public_address_without_auth_warns() -> None:
    assert exposure_warnings("127.0.0.1", auth_enabled=False) == []
    assert exposure_warnings("0.0.0.0", auth_enabled=True) == []
    (warning,) = exposure_warnings("0.0.0.0", auth_enabled=False)
    assert "0.0.0.0" in warning and "authentication OFF" in warning


def test_short_jwt_secret_warns_without_showing_it() -> None:
    (warning,) = exposure_warnings("127.0.0.1", auth_enabled=True, jwt_secret=SecretStr("hunter2"))
    assert "7 bytes" in warning and "hunter2" not in warning
    assert exposure_warnings("127.0.0.1", auth_enabled=True, jwt_secret=SecretStr(SECRET)) == []


def test_install_logs_the_exposure_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="peregrine.hardening"):
        build(settings(host="0.0.0.0"))
    assert "authentication OFF" in caplog.text


async def test_installed_middlewares_enforce_auth_then_limits() -> None:
    app = build(settings(api_key_list=("sk-1",), jwt_secret=SecretStr(SECRET)))
    assert app.state.auth_enabled and app.state.admission.limit == 2
    good = {"Authorization": "Bearer sk-1"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/v1/completions", content=b"x" * 1000)).status_code == 401, "auth before body"
        assert (await c.post("/v1/completions", content=b"x" * 1000, headers=good)).status_code == 413
        assert (await c.post("/v1/completions", json={}, headers=good)).status_code == 200
        token = mint_token(SECRET, "team", "tok")
        ok = await c.post("/v1/completions", json={}, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
        app.state.draining = True
        assert (await c.post("/v1/completions", json={}, headers=good)).status_code == 503


async def test_rate_limit_setting_is_applied() -> None:
    app = build(settings(rate_limit_per_s=0.001, rate_limit_burst=1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.post("/v1/completions", json={})).status_code == 200
        assert (await c.post("/v1/completions", json={})).status_code == 429


async def test_draining_server_waits_for_in_flight_requests_then_exits() -> None:
    app = build(settings())
    server = DrainingServer(uvicorn.Config(app), app, shutdown_timeout=60)
    assert not await server.on_tick(1)
    app.state.admission.active = 2
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.draining and not server.should_exit
    assert not await server.on_tick(1), "requests still in flight"
    app.state.admission.active = 0
    assert await server.on_tick(1), "drained: uvicorn may shut down"
    assert server._captured_signals == [], "the signal is not re-raised, so the process exits 0"


async def test_draining_server_gives_up_at_the_deadline_and_second_signal_forces() -> None:
    app = build(settings())
    server = DrainingServer(uvicorn.Config(app), app, shutdown_timeout=0)
    app.state.admission.active = 1
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.sleep(0)
    assert await server.on_tick(1), "shutdown_timeout 0: stop waiting at once"
    forced = DrainingServer(uvicorn.Config(app), app, shutdown_timeout=60)
    forced.handle_exit(signal.SIGTERM, None)
    forced.handle_exit(signal.SIGINT, None)
    assert forced.should_exit and forced.force_exit


class FakeEngine:
    """Just enough of AsyncEngine for the health routes."""

    model_name, device, dtype, max_model_len = "fake", "cpu", "float32", 128

    def __init__(self) -> None:
        self.alive, self.age, self.running = True, 0.0, 0

    def stats(self):
        from engine.types import EngineStats

        return EngineStats(running=self.running, waiting=0, kv_used_blocks=3 * self.running, kv_total_blocks=10,
                           block_size=16, preemptions_total=0, prompt_tokens_total=0, generated_tokens_total=0,
                           steps_total=5, last_step_age_s=self.age, alive=self.alive)  # fmt: skip


async def test_readiness_tells_the_truth() -> None:
    from app.server import create_app

    engine = FakeEngine()
    app = create_app(None, SimpleNamespace(**(vars(settings()) | {"engine_stall_timeout": 30.0})))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:

        async def ready() -> tuple[int, str]:
            r = await c.get("/ready")
            return r.status_code, r.json()["status"]

        assert await ready() == (503, "loading")
        assert (await c.get("/health")).status_code == 200, "alive while loading"
        app.state.engine = engine
        assert await ready() == (200, "ready")
        engine.running, engine.age = 1, 31.0
        assert await ready() == (503, "stalled")
        stats = (await c.get("/health/engine")).json()
        assert stats["status"] == "stalled" and stats["running"] == 1 and stats["kv_used_blocks"] == 3
        assert stats["http_active"] == 0 and stats["http_admission_limit"] == 2
        engine.age = 0.5
        app.state.draining = True
        assert await ready() == (503, "draining")
        assert (await c.get("/health")).status_code == 200
        app.state.draining = False
        engine.alive = False
        assert await ready() == (503, "dead")
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/health/engine")).status_code == 503


def test_the_default_bind_is_loopback() -> None:
    import config

    assert is_loopback(config.Settings.model_fields["host"].default)
