"""Authentication and per-client rate limiting, as one ASGI middleware in front of every route.

Two kinds of credentials, both sent as `Authorization: Bearer <credential>` (or as `x-api-key: <credential>`,
the header Anthropic's clients send):

- API keys: `settings.api_keys` (comma-separated) and/or `settings.api_keys_file` (one key per line, `#`
  comments). A presented key is compared with *every* configured key in constant time
  (`hmac.compare_digest`), so neither the match nor its position leaks through timing.
- JWTs (HS256, `settings.jwt_secret`), the scheme of the Falcon proxy this server replaces: the token must
  carry `team_id` and `token_id` claims; `exp` / `nbf` are honoured when present. Mint one with
  `python -m app.auth mint --secret S --team-id T --token-id I --ttl 3600`.

With neither configured, authentication is off. Health routes (`/health`, `/health/...`, `/ready`,
`/v1/health`) are always open, so load balancers and orchestrators can probe without a secret.

Failures answer in the OpenAI error envelope: 401 for a missing, unknown, expired or badly signed
credential (the SDKs raise `AuthenticationError`), 403 for a correctly signed JWT that lacks the claims
(`PermissionDeniedError`). Credentials are never logged; a client is named by a short hash of its key or by
its JWT's `team_id/token_id`.

The rate limit is a token bucket per client (per key, per JWT token id, or per peer address with auth off):
`rate_limit_per_s` requests per second sustained, `rate_limit_burst` at once; an empty bucket answers 429
with `Retry-After`.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import logging
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jwt

from app.limits import header, is_open_path, route_path, send_error

log = logging.getLogger("peregrine.auth")

JWT_ALGORITHM = "HS256"
REQUIRED_CLAIMS = ("team_id", "token_id")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling. `name` is safe to log; it never contains the credential."""

    kind: str  # "api_key" | "jwt" | "anonymous"
    name: str
    team_id: str | None = None
    token_id: str | None = None


class AuthFailure(Exception):
    """Why a request was refused: status 401 or 403, a client-facing message, an envelope code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def parse_api_keys(keys: str | None, keys_file: str | Path | None = None) -> tuple[str, ...]:
    """The configured keys: the comma list plus the file's lines (blank lines and `#` comments skipped)."""
    found = [k.strip() for k in (keys or "").split(",")]
    if keys_file:
        for line in Path(keys_file).read_text(encoding="utf-8").splitlines():
            found.append(line.split("#", 1)[0].strip())
    return tuple(dict.fromkeys(k for k in found if k))


def key_name(key: str) -> str:
    """A loggable name for an API key: a short hash, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


class Authenticator:
    """Turns an `Authorization` header into a `Principal`, or raises `AuthFailure`."""

    def __init__(self, api_keys: Sequence[str] = (), jwt_secret: str | None = None) -> None:
        self._keys = tuple(k.encode() for k in api_keys)
        self._jwt_secret = jwt_secret or None

    @property
    def enabled(self) -> bool:
        return bool(self._keys) or self._jwt_secret is not None

    def authenticate(self, authorization: str | None) -> Principal:
        credential = _bearer(authorization)
        if self._match_key(credential):
            return Principal("api_key", key_name(credential))
        if self._jwt_secret is not None and credential.count(".") == 2:
            return self._verify_jwt(credential)
        raise AuthFailure(401, "Invalid API key or token.", "invalid_api_key")

    def _match_key(self, credential: str) -> bool:
        presented = credential.encode()
        matched = False
        for key in self._keys:  # compare with every key: the time does not depend on which one matches
            matched |= hmac.compare_digest(presented, key)
        return matched

    def _verify_jwt(self, token: str) -> Principal:
        try:
            claims = jwt.decode(token, self._jwt_secret, algorithms=[JWT_ALGORITHM])
        except jwt.ExpiredSignatureError:
            raise AuthFailure(401, "The token has expired.", "token_expired") from None
        except jwt.ImmatureSignatureError:
            raise AuthFailure(401, "The token is not valid yet (nbf).", "invalid_token") from None
        except jwt.InvalidTokenError:
            raise AuthFailure(401, "Invalid API key or token.", "invalid_token") from None
        missing = [c for c in REQUIRED_CLAIMS if not isinstance(claims.get(c), str) or not claims[c]]
        if missing:
            raise AuthFailure(
                403, f"The token lacks the required claim(s): {', '.join(missing)}.", "missing_claims"
            )
        team, token_id = claims["team_id"], claims["token_id"]
        return Principal("jwt", f"{team}/{token_id}", team_id=team, token_id=token_id)


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise AuthFailure(
            401, "Missing credentials: send 'Authorization: Bearer <API key or token>'.", "missing_api_key"
        )
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise AuthFailure(
            401, "Malformed Authorization header: expected 'Bearer <API key or token>'.", "invalid_api_key"
        )
    return credential.strip()


def mint_token(secret: str, team_id: str, token_id: str, ttl_s: float | None = 3600, **extra: object) -> str:
    """An HS256 token with the claims this server requires; `ttl_s` None or <= 0 means no `exp`."""
    now = int(time.time())
    claims: dict[str, object] = {"team_id": team_id, "token_id": token_id, "iat": now, **extra}
    if ttl_s is not None and ttl_s > 0:
        claims.setdefault("exp", now + int(math.ceil(ttl_s)))  # an explicit exp claim wins
    return jwt.encode(claims, secret, algorithm=JWT_ALGORITHM)


class RateLimiter:
    """Token buckets keyed by client name: `rate` tokens per second, at most `burst` stored.

    `acquire` takes one token and returns 0.0, or returns how many seconds until one is available (the
    request is refused and nothing is taken). Idle buckets are forgotten beyond `max_clients` (LRU).
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst = rate, burst
        self._max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # name -> (tokens, stamp)

    def acquire(self, name: str) -> float:
        now = self._clock()
        tokens, stamp = self._buckets.pop(name, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - stamp) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[name] = (tokens, now)
        while len(self._buckets) > self._max_clients:
            self._buckets.popitem(last=False)
        return wait


class AuthMiddleware:
    """ASGI middleware: authenticate, rate-limit, and put the `Principal` in `scope["state"]["principal"]`."""

    def __init__(self, app, authenticator: Authenticator, rate_limiter: RateLimiter | None = None) -> None:
        self.app = app
        self.authenticator = authenticator
        self.rate_limiter = rate_limiter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or is_open_path(route_path(scope)):
            await self.app(scope, receive, send)
            return
        try:
            principal = self._principal(scope)
        except AuthFailure as failure:
            log.info("refused %s %s: %s", scope.get("method"), scope.get("path"), failure.code)
            error_type = "authentication_error" if failure.status == 401 else "permission_error"
            headers = [(b"www-authenticate", b"Bearer")] if failure.status == 401 else []
            await send_error(send, failure.status, failure.message, error_type, failure.code, headers)
            return
        if self.rate_limiter is not None:
            wait = self.rate_limiter.acquire(principal.name)
            if wait > 0:
                retry = str(max(1, math.ceil(wait)))
                message = f"Rate limit exceeded for {principal.name}; retry in {retry} s."
                await send_error(
                    send,
                    429,
                    message,
                    "rate_limit_error",
                    "rate_limit_exceeded",
                    [(b"retry-after", retry.encode())],
                )
                return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    def _principal(self, scope) -> Principal:
        if not self.authenticator.enabled:
            client = scope.get("client") or ("unknown", 0)
            return Principal("anonymous", f"peer-{client[0]}")
        api_key = header(scope, b"x-api-key")
        authorization = header(scope, b"authorization") or (f"Bearer {api_key}" if api_key else None)
        return self.authenticator.authenticate(authorization)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m app.auth mint ...`: print a token for the server's `--jwt-secret`."""
    parser = argparse.ArgumentParser(prog="python -m app.auth", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    mint = sub.add_parser("mint", help="mint an HS256 JWT with team_id and token_id claims")
    secret = mint.add_mutually_exclusive_group(required=True)
    secret.add_argument("--secret", help="the server's jwt_secret (visible in `ps`; prefer --secret-file)")
    secret.add_argument("--secret-file", type=Path, help="a file holding the secret")
    mint.add_argument("--team-id", required=True)
    mint.add_argument("--token-id", required=True)
    mint.add_argument("--ttl", type=float, default=3600.0, help="seconds until `exp`; 0 for no expiry")
    mint.add_argument("--claims", default="{}", help="extra claims as a JSON object")
    args = parser.parse_args(argv)
    key = args.secret if args.secret is not None else args.secret_file.read_text(encoding="utf-8").strip()
    extra = json.loads(args.claims)
    if not isinstance(extra, dict):
        parser.error("--claims must be a JSON object")
    print(mint_token(key, args.team_id, args.token_id, args.ttl, **extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
