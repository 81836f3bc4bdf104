"""API keys (router.auth) and what the router may log, over a FakeBackend.

The real deployment's version (every /v1/* route, Ray's log files) is tests/hardening/test_api_keys.py.
"""

from __future__ import annotations

import base64
import hmac
import logging

import pytest
from fastapi.testclient import TestClient

from router.app import build_app
from router.auth import APIKeyMiddleware
from router.config import API_KEY_ENV, ServerConfig
from testkit.backend import FakeBackend
from tests.router.conftest import MAX_MODEL_LEN, MODEL_NAME

USER = [{"role": "user", "content": "Hello"}]


def keyed_client(tokenizer, api_key: str | None = "alpha,beta", **server) -> TestClient:
    app = build_app(
        FakeBackend(tokenizer), tokenizer, MODEL_NAME, MAX_MODEL_LEN, server=ServerConfig(api_key=api_key, **server)
    )
    return TestClient(app, raise_server_exceptions=False)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_key_works_and_anything_else_is_401_with_the_envelope(tokenizer):
    client = keyed_client(tokenizer)
    for key in ("alpha", "beta"):
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200
        assert (
            client.post(
                "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers=bearer(key)
            ).status_code
            == 200
        )
    assert client.get("/v1/models", headers={"Authorization": "bearer  alpha "}).status_code == 200
    for headers in (
        {},
        bearer("gamma"),
        bearer("alpha,beta"),
        bearer("alph"),
        bearer(""),
        {"Authorization": "alpha"},
        {"Authorization": "Token alpha"},
        {"X-API-Key": "alpha"},
    ):
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.json() == {
            "error": {
                "message": r.json()["error"]["message"],
                "type": "AuthenticationError",
                "param": None,
                "code": 401,
            }
        }
        assert r.headers["www-authenticate"] == "Bearer"
    assert "no API key was sent" in client.get("/v1/models").json()["error"]["message"]
    assert "not valid" in client.get("/v1/models", headers=bearer("gamma")).json()["error"]["message"]


def test_open_routes_stay_open_and_the_rest_are_closed(tokenizer):
    client = keyed_client(tokenizer)
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    for method, path in (
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/status"),
        ("GET", "/dashboard"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/anything"),
    ):
        assert client.request(method, path, json={}).status_code == 401, path
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


def test_a_browser_gets_a_basic_challenge_on_the_dashboard_and_basic_credentials_work(tokenizer):
    client = keyed_client(tokenizer)
    r = client.get("/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith('Basic realm="baton"')
    good = base64.b64encode(b"anyone:beta").decode()
    bad = base64.b64encode(b"anyone:delta").decode()
    assert client.get("/dashboard", headers={"Authorization": f"Basic {good}"}).status_code == 200
    assert client.get("/v1/status", headers={"Authorization": f"Basic {good}"}).status_code == 200
    assert client.get("/dashboard", headers={"Authorization": f"Basic {bad}"}).status_code == 401
    assert client.get("/dashboard", headers={"Authorization": "Basic %%%"}).status_code == 401


def test_the_comparison_checks_every_key():
    # Constant time: compare_digest against each configured key, whichever matches.
    calls: list[bytes] = []
    middleware = APIKeyMiddleware(None, ("k1", "k2", "k3"))
    original = hmac.compare_digest
    try:
        hmac.compare_digest = lambda a, b: calls.append(b) or original(a, b)
        assert middleware.authorized(b"Bearer k1")
    finally:
        hmac.compare_digest = original
    assert calls == [b"k1", b"k2", b"k3"]


def test_no_key_configured_means_no_authentication(tokenizer):
    client = keyed_client(tokenizer, api_key=None)
    assert client.get("/v1/models").status_code == 200
    assert "securitySchemes" not in client.get("/openapi.json").json()["components"]


def test_keys_come_from_the_environment_when_not_configured_and_never_show_in_repr():
    assert ServerConfig().with_api_key_from_env({API_KEY_ENV: " k1, k2 "}).api_keys() == ("k1", "k2")
    assert ServerConfig(api_key="mine").with_api_key_from_env({API_KEY_ENV: "env"}).api_keys() == ("mine",)
    assert ServerConfig().with_api_key_from_env({API_KEY_ENV: "  "}).api_keys() == ()
    assert ServerConfig().with_api_key_from_env({}).api_keys() == ()
    assert "s3cret" not in repr(ServerConfig(api_key="s3cret"))
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key=" , ")


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompts_and_completions_are_logged_only_when_the_operator_asks(tokenizer, caplog, log_prompts):
    client = keyed_client(tokenizer, api_key="alpha", log_prompts=log_prompts)
    marker = "okapi-narwhal-2211"
    with caplog.at_level(logging.DEBUG):
        r = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": marker}], "max_tokens": 12},
            headers=bearer("alpha"),
        )
        client.post(
            "/v1/completions", json={"prompt": marker, "max_tokens": 12, "stream": True}, headers=bearer("alpha")
        )
        client.get("/v1/models", headers=bearer("wrong-alpha"))
    completion = r.json()["choices"][0]["message"]["content"]
    assert len(completion) > 10
    text = caplog.text
    assert "trace chatcmpl-" in text  # debug logging was on: the absence below means something
    assert "alpha" not in text
    assert (marker in text) == log_prompts
    assert (completion in text) == log_prompts
    if log_prompts:
        assert {r.name for r in caplog.records if marker in r.getMessage()} == {"baton.router.requests"}
