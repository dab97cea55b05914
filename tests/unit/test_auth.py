"""API keys, JWTs, the auth middleware and the per-client rate limit (no model, no server)."""

from __future__ import annotations

import contextlib
import hmac
import logging
import subprocess
import sys
import time
from pathlib import Path

import jwt
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from app import auth
from app.auth import Authenticator, AuthFailure, AuthMiddleware, RateLimiter, mint_token, parse_api_keys

REPO = Path(__file__).resolve().parents[2]
SECRET = "unit-test-secret-0123456789abcdef-0123456789abcdef-0123456789abcdef"
KEYS = ("sk-alpha-000", "sk-bravo-111", "sk-charlie-222")


def test_parse_api_keys_merges_list_and_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  # ops\nsk-a\n", encoding="utf-8")
    assert parse_api_keys(" sk-a, ,sk-b ", keys_file) == ("sk-a", "sk-b", "sk-file-1", "sk-file-2")
    assert parse_api_keys(None, None) == ()
    assert parse_api_keys("", None) == ()


@pytest.mark.parametrize("key", KEYS)
def test_each_configured_key_authenticates(key: str) -> None:
    principal = Authenticator(KEYS).authenticate(f"Bearer {key}")
    assert principal.kind == "api_key"
    assert key not in principal.name and principal.name.startswith("key-")


def test_key_comparison_is_constant_time_over_all_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    authenticator = Authenticator(KEYS)
    for presented in (KEYS[0], KEYS[2], "sk-wrong"):
        calls.clear()
        with contextlib.suppress(AuthFailure):
            authenticator.authenticate(f"Bearer {presented}")
        assert len(calls) == len(KEYS), "every key is compared, whichever matches"


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("Basic dXNlcjpwdw==", "invalid_api_key"),
        ("Bearer ", "invalid_api_key"),
        ("Bearer sk-alpha-00", "invalid_api_key"),
        ("Bearer sk-alpha-0000", "invalid_api_key"),
    ],
)
def test_bad_key_headers_are_401(header: str | None, code: str) -> None:
    with pytest.raises(AuthFailure) as info:
        Authenticator(KEYS).authenticate(header)
    assert info.value.status == 401
    assert info.value.code == code


def test_scheme_is_case_insensitive() -> None:
    assert Authenticator(KEYS).authenticate(f"bearer {KEYS[1]}").kind == "api_key"


def test_jwt_with_claims_authenticates() -> None:
    token = mint_token(SECRET, "tenstorrent", "debug-test", ttl_s=60)
    principal = Authenticator(jwt_secret=SECRET).authenticate(f"Bearer {token}")
    assert (principal.kind, principal.team_id, principal.token_id) == ("jwt", "tenstorrent", "debug-test")
    assert principal.name == "tenstorrent/debug-test"


def test_seed_style_jwt_without_exp_authenticates() -> None:
    token = jwt.encode({"team_id": "tenstorrent", "token_id": "debug-test"}, SECRET, algorithm="HS256")
    assert Authenticator(jwt_secret=SECRET).authenticate(f"Bearer {token}").token_id == "debug-test"


def _jwt_failure(token: str, *, secret: str = SECRET, keys: tuple[str, ...] = ()) -> AuthFailure:
    with pytest.raises(AuthFailure) as info:
        Authenticator(keys, jwt_secret=secret).authenticate(f"Bearer {token}")
    return info.value


def test_expired_jwt_is_401() -> None:
    token = jwt.encode(
        {"team_id": "t", "token_id": "i", "exp": int(time.time()) - 10}, SECRET, algorithm="HS256"
    )
    failure = _jwt_failure(token)
    assert (failure.status, failure.code) == (401, "token_expired")
    assert "expired" in failure.message


def test_not_yet_valid_jwt_is_401() -> None:
    token = jwt.encode(
        {"team_id": "t", "token_id": "i", "nbf": int(time.time()) + 3600}, SECRET, algorithm="HS256"
    )
    assert _jwt_failure(token).status == 401


def test_jwt_signed_with_another_secret_is_401() -> None:
    token = mint_token("some-other-secret-0123456789abcd", "t", "i")
    failure = _jwt_failure(token)
    assert (failure.status, failure.code) == (401, "invalid_token")


def test_unsigned_and_other_algorithm_jwts_are_401() -> None:
    unsigned = jwt.encode({"team_id": "t", "token_id": "i"}, None, algorithm="none")
    assert _jwt_failure(unsigned).status == 401
    hs512 = jwt.encode({"team_id": "t", "token_id": "i"}, SECRET, algorithm="HS512")
    assert _jwt_failure(hs512).status == 401


def test_tampered_jwt_is_401() -> None:
    header, payload, signature = mint_token(SECRET, "t", "i").split(".")
    forged_payload = jwt.utils.base64url_encode(b'{"team_id":"admin","token_id":"i"}').decode()
    assert _jwt_failure(f"{header}.{forged_payload}.{signature}").status == 401


@pytest.mark.parametrize(
    "claims", [{"team_id": "t"}, {"token_id": "i"}, {"team_id": "", "token_id": "i"}, {}]
)
def test_signed_jwt_without_required_claims_is_403(claims: dict) -> None:
    token = jwt.encode(claims, SECRET, algorithm="HS256")
    failure = _jwt_failure(token)
    assert (failure.status, failure.code) == (403, "missing_claims")


def test_jwt_is_refused_when_only_keys_are_configured() -> None:
    token = mint_token(SECRET, "t", "i")
    with pytest.raises(AuthFailure) as info:
        Authenticator(KEYS).authenticate(f"Bearer {token}")
    assert info.value.status == 401


def test_keys_and_jwt_together() -> None:
    both = Authenticator(KEYS, jwt_secret=SECRET)
    assert both.authenticate(f"Bearer {KEYS[0]}").kind == "api_key"
    assert both.authenticate(f"Bearer {mint_token(SECRET, 't', 'i')}").kind == "jwt"


def test_auth_is_off_without_keys_or_secret() -> None:
    assert not Authenticator().enabled
    assert Authenticator(KEYS).enabled and Authenticator(jwt_secret=SECRET).enabled


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_limiter_allows_burst_then_refuses_with_wait() -> None:
    clock = FakeClock()
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a") == pytest.approx(0.5)
    assert limiter.acquire("b") == 0.0, "buckets are per client"
    clock.now += 0.5
    assert limiter.acquire("a") == 0.0
    assert limiter.acquire("a") > 0.0
    clock.now += 100.0
    assert [limiter.acquire("a") for _ in range(4)].count(0.0) == 3, "a bucket never holds more than burst"


def test_rate_limiter_forgets_idle_clients_beyond_the_bound() -> None:
    limiter = RateLimiter(rate=1.0, burst=1, max_clients=2, clock=FakeClock())
    for name in ("a", "b", "c"):
        limiter.acquire(name)
    assert limiter.acquire("a") == 0.0, "a was evicted, so it starts with a full bucket"
    assert limiter.acquire("c") > 0.0


def test_rate_limiter_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        RateLimiter(rate=0, burst=1)


def _client(authenticator: Authenticator, limiter: RateLimiter | None = None) -> TestClient:
    api = FastAPI()

    @api.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @api.get("/v1/health")
    def v1_health() -> dict:
        return {"status": "OK"}

    @api.get("/health/engine")
    def engine_health() -> dict:
        return {"alive": True}

    @api.get("/v1/models")
    def models(request: Request) -> dict:
        principal = request.scope["state"]["principal"]
        return {"who": principal.name, "team": principal.team_id}

    @api.post("/v1/chat/completions")
    def chat() -> dict:
        return {"ok": True}

    api.add_middleware(AuthMiddleware, authenticator=authenticator, rate_limiter=limiter)
    return TestClient(api)


def _assert_envelope(response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    return error


def test_middleware_keeps_health_open_and_guards_the_rest() -> None:
    client = _client(Authenticator(KEYS, jwt_secret=SECRET))
    for path in ("/health", "/v1/health", "/health/engine"):
        assert client.get(path).status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/openapi.json")):
        response = client.request(method, path)
        error = _assert_envelope(response, 401, "authentication_error")
        assert error["code"] == "missing_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[2]}"})
    assert ok.status_code == 200 and ok.json()["who"].startswith("key-")
    token = mint_token(SECRET, "falcon", "t-1")
    ok = client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert ok.json() == {"who": "falcon/t-1", "team": "falcon"}


def test_middleware_answers_403_for_a_token_without_claims() -> None:
    client = _client(Authenticator(jwt_secret=SECRET))
    token = jwt.encode({"team_id": "falcon"}, SECRET, algorithm="HS256")
    error = _assert_envelope(
        client.get("/v1/models", headers={"Authorization": f"Bearer {token}"}), 403, "permission_error"
    )
    assert "token_id" in error["message"]


def test_middleware_never_logs_credentials(caplog: pytest.LogCaptureFixture) -> None:
    client = _client(Authenticator(KEYS, jwt_secret=SECRET))
    token = mint_token(SECRET, "falcon", "t-1")
    with caplog.at_level(logging.DEBUG):
        for credential in ("sk-leaked-guess", KEYS[0], token, "a.b.c"):
            client.get("/v1/models", headers={"Authorization": f"Bearer {credential}"})
    logged = caplog.text
    for secret in ("sk-leaked-guess", KEYS[0], token, SECRET):
        assert secret not in logged


def test_middleware_rate_limits_per_key_with_retry_after() -> None:
    client = _client(Authenticator(KEYS), RateLimiter(rate=0.001, burst=2))
    first = {"Authorization": f"Bearer {KEYS[0]}"}
    second = {"Authorization": f"Bearer {KEYS[1]}"}
    assert [client.get("/v1/models", headers=first).status_code for _ in range(2)] == [200, 200]
    refused = client.get("/v1/models", headers=first)
    error = _assert_envelope(refused, 429, "rate_limit_error")
    assert error["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert client.get("/v1/models", headers=second).status_code == 200, "another key has its own bucket"
    assert client.get("/health").status_code == 200, "health is never rate limited"


def test_middleware_rate_limits_by_peer_when_auth_is_off() -> None:
    client = _client(Authenticator(), RateLimiter(rate=0.001, burst=1))
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/models").status_code == 429


def test_mint_cli_prints_a_token_the_server_accepts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    assert (
        auth.main(
            ["mint", "--secret-file", str(secret_file), "--team-id", "t", "--token-id", "i", "--ttl", "60"]
        )
        == 0
    )
    token = capsys.readouterr().out.strip()
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert claims["team_id"] == "t" and claims["token_id"] == "i"
    assert 0 < claims["exp"] - time.time() <= 61
    assert Authenticator(jwt_secret=SECRET).authenticate(f"Bearer {token}").token_id == "i"


def test_mint_cli_runs_as_a_module() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.auth",
            "mint",
            "--secret",
            SECRET,
            "--team-id",
            "t",
            "--token-id",
            "i",
            "--ttl",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    claims = jwt.decode(result.stdout.strip(), SECRET, algorithms=["HS256"])
    assert claims["token_id"] == "i" and "exp" not in claims
