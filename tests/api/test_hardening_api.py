"""Auth, error classes and graceful shutdown against a real server on the tiny model (issue 5).

One server runs with auth on (two API keys and a JWT secret), a per-client rate limit, a small body limit
and a short request timeout. (SIGTERM is tested at the end of test_soak.py, on that module's server.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import jwt
import openai
import pytest
from _tiny_server import HeldUpload, TinyServer, wait_until

from app.auth import mint_token

pytestmark = pytest.mark.slow

KEYS = ("sk-peregrine-test-one", "sk-peregrine-test-two")
SECRET = "issue-5-test-secret-0123456789abcdef-0123456789abcdef"
BURST = 100  # at least the guarded routes (each family adds some): one key walks them all below
MAX_BODY = 65536
REQUEST_TIMEOUT_S = 10  # the slow-upload test waits it out; every generation here is 1-2 tokens of the tiny model
HI = [{"role": "user", "content": "hi"}]
OPEN_PATHS = {"/health", "/health/engine", "/health/ready", "/ready", "/v1/health", "/"}  # "/": the chat page


@pytest.fixture(scope="module")
def auth_server(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    server = TinyServer(
        tiny_model_dir.path, tmp_path_factory.mktemp("auth-server"),
        "--api-keys", ",".join(KEYS), "--jwt-secret", SECRET,
        "--rate-limit-per-s", "0.001", "--rate-limit-burst", str(BURST),
        "--max-body-bytes", str(MAX_BODY), "--request-timeout", str(REQUEST_TIMEOUT_S),
    )  # fmt: skip
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


_token_counter = iter(range(10**6))


def fresh_token(**claims) -> str:
    """A valid token with its own token_id, hence its own rate-limit bucket."""
    return mint_token(SECRET, "issue5", f"tok-{next(_token_counter)}", ttl_s=600, **claims)


def sdk(server: TinyServer, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=120)


def envelope(r: httpx.Response, status: int, error_type: str) -> dict:
    assert r.status_code == status, (r.request.method, r.request.url, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == error_type
    return error


def concrete_routes(server: TinyServer) -> list[tuple[str, str]]:
    schema = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
    routes = []
    for path, methods in schema["paths"].items():
        for method in methods:
            routes.append((method.upper(), path.replace("{model_id}", "tiny").replace("{provider_id}", "x")))
    return [*routes, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route")]


def test_every_non_health_route_refuses_bad_credentials(auth_server: TinyServer) -> None:
    expired = jwt.encode(
        {"team_id": "t", "token_id": "i", "exp": int(time.time()) - 60}, SECRET, algorithm="HS256"
    )
    bad_signature = mint_token("another-secret-0123456789abcdef-0123456789", "t", "i")
    unsigned = jwt.encode({"team_id": "t", "token_id": "i"}, None, algorithm="none")
    bad = {
        "none": {},
        "wrong key": {"Authorization": "Bearer sk-peregrine-test-thre"},
        "not bearer": {"Authorization": f"Basic {KEYS[0]}"},
        "expired jwt": {"Authorization": f"Bearer {expired}"},
        "badly signed jwt": {"Authorization": f"Bearer {bad_signature}"},
        "unsigned jwt": {"Authorization": f"Bearer {unsigned}"},
    }
    routes = concrete_routes(auth_server)
    guarded = [(m, p) for m, p in routes if p not in OPEN_PATHS]
    assert len(guarded) >= 10 and ("POST", "/v1/chat/completions") in guarded
    with httpx.Client(base_url=auth_server.url, timeout=60) as http:
        for method, path in guarded:
            for label, headers in bad.items():
                r = http.request(method, path, headers=headers, json={})
                assert r.headers["www-authenticate"] == "Bearer", (label, path)
                if path.startswith("/api/"):  # Ollama's routes answer in Ollama's envelope
                    assert r.status_code == 401 and isinstance(r.json()["error"], str), (label, path, r.text)
                    continue
                if path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's envelope
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
                    continue
                error = envelope(r, 401, "authentication_error")
                if label == "expired jwt":
                    assert error["code"] == "token_expired"
        for path in OPEN_PATHS:
            assert http.get(path).status_code == 200, path
        for headers in ({"Authorization": f"Bearer {KEYS[1]}"}, {"Authorization": f"Bearer {fresh_token()}"}):
            for method, path in guarded:
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code not in (401, 403, 429), (method, path, r.text)


def test_credentials_never_reach_the_log(auth_server: TinyServer) -> None:
    token = fresh_token()
    httpx.get(f"{auth_server.url}/v1/models", headers={"Authorization": f"Bearer {token}"})
    httpx.get(f"{auth_server.url}/v1/models", headers={"Authorization": "Bearer sk-a-guess-that-is-wrong"})
    log = auth_server.log_path.read_text(errors="replace")
    for secret in (*KEYS, token, SECRET, "sk-a-guess-that-is-wrong"):
        assert secret not in log


def test_sdk_raises_the_matching_error_classes(auth_server: TinyServer) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(auth_server, "sk-wrong").models.list()
    assert info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        sdk(auth_server, fresh_token(exp=int(time.time()) - 5)).chat.completions.create(
            model="tiny", messages=HI
        )
    claimless = jwt.encode({"team_id": "t"}, SECRET, algorithm="HS256")
    with pytest.raises(openai.PermissionDeniedError) as info:
        sdk(auth_server, claimless).chat.completions.create(model="tiny", messages=HI, max_tokens=1)
    assert "token_id" in info.value.message

    good = sdk(auth_server, fresh_token())
    ok = good.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        good.chat.completions.create(model="tiny", messages=HI, temperature=5)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        good.completions.create(model="tiny", prompt=[10**7], max_tokens=1)
    assert info.value.body["param"] == "prompt" and "vocabulary" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        good.chat.completions.create(model="tiny", messages=HI, stop=[str(i) for i in range(17)])
    assert info.value.body["param"] == "stop"
    with pytest.raises(openai.NotFoundError) as info:
        good.chat.completions.create(model="no-such-model", messages=HI, max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as info:
        good.completions.create(model="tiny", prompt="x" * (MAX_BODY + 1), max_tokens=1)
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"


def test_rate_limit_is_per_client_with_retry_after(auth_server: TinyServer) -> None:
    token = fresh_token()
    with httpx.Client(base_url=auth_server.url, headers={"Authorization": f"Bearer {token}"}) as http:
        statuses = [http.get("/v1/models").status_code for _ in range(BURST)]
        assert statuses == [200] * BURST
    with pytest.raises(openai.RateLimitError) as info:
        sdk(auth_server, token).chat.completions.create(model="tiny", messages=HI, max_tokens=1)
    assert info.value.body["code"] == "rate_limit_exceeded"
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert sdk(auth_server, fresh_token()).models.list().data, "another token has its own bucket"
    assert httpx.get(f"{auth_server.url}/health").status_code == 200, "health is never rate limited"


def test_bad_bodies_are_400_with_a_clear_message(auth_server: TinyServer) -> None:
    headers = {"Authorization": f"Bearer {fresh_token()}", "content-type": "application/json"}
    with httpx.Client(base_url=auth_server.url, headers=headers, timeout=60) as http:
        error = envelope(
            http.post("/v1/chat/completions", content=b'{"messages": [\xff]}'), 400, "invalid_request_error"
        )
        assert error["code"] == "invalid_encoding" and "UTF-8" in error["message"]
        error = envelope(
            http.post("/v1/completions", content=b'{"prompt": "x",}'), 400, "invalid_request_error"
        )
        assert error["code"] == "invalid_json" and "column" in error["message"]
        for body, param in (
            ({"model": "tiny", "messages": []}, "messages"),
            ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
            ({"model": "tiny", "prompt": {"text": "x"}}, "prompt"),
            ({"model": "tiny", "prompt": "x", "n": "two"}, "n"),
            ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            assert envelope(http.post(path, json=body), 400, "invalid_request_error")["param"] == param


def test_slow_upload_times_out_with_408(auth_server: TinyServer) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    held = HeldUpload(auth_server.port, "/v1/completions", body, {"Authorization": f"Bearer {KEYS[0]}"})
    status, payload = held.read()  # never finish the body: the server gives up after REQUEST_TIMEOUT_S
    assert status == 408
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    stats = wait_until(
        lambda: (s := auth_server.engine_stats())["http_in_flight"] == 0 and s, 60, "slot freed"
    )
    assert stats["http_active"] == 0
