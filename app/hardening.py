"""Wiring for auth, limits and graceful shutdown: what `create_app` and `main.py` call.

- `install_hardening(app, settings)` adds the limits and auth middlewares (auth outside, so an
  unauthenticated client never costs a body read), and puts the shared state on `app.state`:
  `admission` (generation requests in flight, see `app/limits.py`) and `draining` (True once a shutdown
  signal arrived; readiness and every guarded route answer 503 from then on). It also warns at start when
  the server listens on a public address with auth off, or with a weak JWT secret.
- `DrainingServer` is a `uvicorn.Server` whose SIGTERM / SIGINT first *drain*: new requests and readiness
  get 503 while the listening socket stays open (so a load balancer sees "not ready", not "connection
  refused"), in-flight requests and streams finish, for at most `shutdown_timeout` seconds; then uvicorn's
  own shutdown runs and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import time
from collections.abc import Collection
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from app.auth import Authenticator, AuthMiddleware, RateLimiter
from app.limits import Admission, LimitsMiddleware

log = logging.getLogger("peregrine.hardening")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
MIN_JWT_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key at least as long as the hash


def install_hardening(app: FastAPI, settings: Any = None, generation: Collection[str] = frozenset()) -> None:
    """Add the limits and auth middlewares; call before any middleware that must see their answers.
    `generation`: the paths of the routes that run the engine (app.limits.generation_paths)."""
    app.state.draining = False
    app.state.admission = Admission(_admission_limit(settings))
    app.add_middleware(
        LimitsMiddleware,
        max_body_bytes=int(_get(settings, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)),
        admission=app.state.admission,
        request_timeout=_get(settings, "request_timeout", None),
        draining=lambda: app.state.draining,
        generation=generation,
    )
    authenticator = Authenticator(
        _get(settings, "api_key_list", ()), _secret(_get(settings, "jwt_secret", None))
    )
    app.add_middleware(AuthMiddleware, authenticator=authenticator, rate_limiter=_rate_limiter(settings))
    app.state.auth_enabled = authenticator.enabled
    if settings is not None:
        for warning in exposure_warnings(
            settings.host, authenticator.enabled, _get(settings, "jwt_secret", None)
        ):
            log.warning(warning)


def _admission_limit(settings: Any) -> int:
    """Running + waiting: a full batch (`max_num_seqs`) plus at most `max_queue` waiting behind it."""
    return int(_get(settings, "max_num_seqs", 64)) + int(_get(settings, "max_queue", 256))


def _rate_limiter(settings: Any) -> RateLimiter | None:
    rate = float(_get(settings, "rate_limit_per_s", 0) or 0)
    if rate <= 0:
        return None
    burst = int(_get(settings, "rate_limit_burst", 0)) or max(1, round(rate))  # default: one second's worth
    return RateLimiter(rate, burst)


def exposure_warnings(host: str, auth_enabled: bool, jwt_secret: Any = None) -> list[str]:
    """What to warn about at start: a public address with auth off; a JWT secret too short to be safe."""
    warnings = []
    if not auth_enabled and not is_loopback(host):
        warnings.append(
            f"Listening on {host}, which other machines can reach, with authentication OFF: anyone who can "
            "reach this port can use the model. Set --api-keys / --api-keys-file or --jwt-secret, or bind "
            "127.0.0.1."
        )
    secret = _secret(jwt_secret)
    if secret is not None and len(secret.encode()) < MIN_JWT_SECRET_BYTES:
        warnings.append(
            f"The JWT secret is {len(secret.encode())} bytes; use at least {MIN_JWT_SECRET_BYTES} random bytes "
            "(e.g. `openssl rand -hex 32`)."
        )
    return warnings


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything


def _get(settings: Any, name: str, default: Any) -> Any:
    value = getattr(settings, name, None) if settings is not None else None
    return default if value is None else value


def _secret(value: Any) -> str | None:
    if value is None:
        return None
    text = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
    return text or None


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before its shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float) -> None:
        if config.timeout_graceful_shutdown is None:  # after the drain: time for last bytes to leave
            config.timeout_graceful_shutdown = 5
        super().__init__(config)
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self._deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in `_captured_signals`: uvicorn would re-raise it after serving and the process
        # would die by the signal instead of exiting 0.
        if self._deadline is not None:
            log.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self._deadline = time.monotonic() + self.shutdown_timeout
        self.app.state.draining = True
        log.info(
            "%s: draining (readiness and new requests answer 503); waiting up to %g s for %d request(s)",
            signal.Signals(sig).name,
            self.shutdown_timeout,
            self.app.state.admission.active,
        )

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self._deadline is None:
            return False
        active = self.app.state.admission.active
        if active == 0:
            log.info("drained: no request in flight")
            return True
        if time.monotonic() >= self._deadline:
            log.warning("shutdown_timeout reached with %d request(s) in flight: cutting them off", active)
            self.config.timeout_graceful_shutdown = 1
            return True
        return False
