"""API keys on a real deployment: every /v1/* route answers 401 without the key (and with a wrong
one) and works with it; the open routes stay open; the key never reaches a log (the router's,
uvicorn's access and error logs, Ray's log files), nor do prompts and completions."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.hardening.corpus import API_KEY

pytestmark = pytest.mark.slow
OPEN = ("/health", "/metrics", "/version")
# One request that must succeed for every route the app has (a new route without one fails here).
EXAMPLES = {
    ("POST", "/v1/chat/completions"): {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ("POST", "/v1/completions"): {"prompt": "Hi", "max_tokens": 2},
    ("GET", "/v1/models"): None,
    ("GET", "/v1/status"): None,
    ("POST", "/tokenize"): {"prompt": "Hi"},
    ("POST", "/detokenize"): {"tokens": [1, 2]},
    ("GET", "/dashboard"): None,
    ("GET", "/health"): None,
    ("GET", "/metrics"): None,
    ("GET", "/version"): None,
}


def app_routes(hardened) -> set[tuple[str, str]]:
    """Every route the app serves, from its OpenAPI schema (built from the app's routes)."""
    paths = httpx.get(hardened.base_url + "/openapi.json").json()["paths"]
    return {(method.upper(), path) for path, operations in paths.items() for method in operations}


def call(base_url: str, method: str, path: str, headers: dict) -> httpx.Response:
    body = EXAMPLES[(method, path)]
    return httpx.request(method, base_url + path, json=body, headers=headers, timeout=120)


def test_every_v1_route_needs_the_key_and_works_with_it(hardened):
    routes = app_routes(hardened)
    assert routes == set(EXAMPLES), "a route without an example: add it to EXAMPLES"
    v1 = sorted(r for r in routes if r[1].startswith("/v1/"))
    assert len(v1) >= 4
    for method, path in sorted(routes):
        with_key = call(hardened.base_url, method, path, {"Authorization": f"Bearer {API_KEY}"})
        assert with_key.status_code == 200, (method, path, with_key.text[:200])
        if path in OPEN:
            assert call(hardened.base_url, method, path, {}).status_code == 200, path
            continue
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Bearer {API_KEY}x"},
            {"Authorization": API_KEY},
            {"Authorization": f"Bearer {API_KEY[:-1]}"},
        ):
            r = call(hardened.base_url, method, path, headers)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            error = r.json()["error"]
            assert error["code"] == 401 and error["type"] == "AuthenticationError" and API_KEY not in r.text
    # A browser: the dashboard challenges with Basic, and Basic credentials carrying the key work.
    r = httpx.get(hardened.base_url + "/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    basic = base64.b64encode(f"operator:{API_KEY}".encode()).decode()
    for path in ("/dashboard", "/v1/status"):
        assert httpx.get(hardened.base_url + path, headers={"Authorization": f"Basic {basic}"}).status_code == 200


def test_the_key_prompts_and_completions_never_reach_a_log(hardened):
    marker = "zebra-quokka-7741"
    with hardened.client() as client:
        r = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": f"Repeat after me: {marker}. Then say {API_KEY}."}],
                "max_tokens": 24,
                "temperature": 0,
            },
        )
        completion = r.json()["choices"][0]["message"]["content"]
        assert r.status_code == 200 and len(completion) >= 20
        client.post("/v1/completions", json={"prompt": f"{marker} {API_KEY}", "max_tokens": 300000})  # a 400
    httpx.get(hardened.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}-wrong"})
    httpx.get(hardened.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    hardened.wait_idle()
    logs = hardened.logs.text()
    # The capture works: the access log has these requests, the trace log this request.
    assert "POST /v1/chat/completions" in logs and "baton.router.trace" in logs
    for secret in (API_KEY, marker, completion):
        assert secret not in logs
    for path in hardened.ray_log_files():
        text = path.read_bytes()
        assert API_KEY.encode() not in text and marker.encode() not in text, path
