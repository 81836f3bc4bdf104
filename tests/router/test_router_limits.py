"""Body limits that need more than a plain request to reach (the corpus covers the rest): bodies
without a Content-Length, a lying Content-Length, a client that leaves mid-body, and the configured
limits themselves."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from router.app import build_app
from router.config import ServerConfig
from testkit.backend import FakeBackend
from tests.router.conftest import MAX_MODEL_LEN, MODEL_NAME, running_server


def app_with(tokenizer, **server):
    return build_app(FakeBackend(tokenizer), tokenizer, MODEL_NAME, MAX_MODEL_LEN, server=ServerConfig(**server))


def test_a_chunked_body_is_cut_off_at_the_limit(tokenizer):

    def chunks():
        yield b'{"messages":[{"role":"user","content":"'
        for _ in range(1000):  # 1 MB in all, unless the server stops reading
            yield b"x" * 1024
        yield b'"}]}'

    with running_server(app_with(tokenizer, max_request_body=4096)) as url:
        try:
            r = httpx.post(url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        except httpx.HTTPError:
            pytest.skip("the server closed the connection before the client read the answer")
        assert r.status_code == 400 and "max_request_body" in r.json()["error"]["message"]
        assert "Content-Length" not in r.json()["error"]["message"]  # found while reading, not declared


def test_configured_limits_apply(tokenizer):
    from fastapi.testclient import TestClient

    client = TestClient(
        app_with(tokenizer, max_stop_sequences=2, max_stop_length=3, max_logprobs=2, max_json_depth=6),
        raise_server_exceptions=False,
    )
    user = [{"role": "user", "content": "hi"}]
    for body, param, words in (
        ({"messages": user, "stop": ["a", "b", "c"]}, "stop", "at most 2"),
        ({"messages": user, "stop": "abcd"}, "stop", "at most 3"),
        ({"messages": user, "logprobs": True, "top_logprobs": 3}, "top_logprobs", "limit of 2"),
        ({"messages": user, "stop_token_ids": [1, 2, 3]}, "stop_token_ids", "at most 2"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": [[1]]}]}]},
            "messages[0].content[0].x[0]",
            "max_json_depth",
        ),
    ):
        error = client.post("/v1/chat/completions", json=body).json()["error"]
        assert (error["code"], error["param"]) == (400, param) and words in error["message"], error
    ok = client.post(
        "/v1/chat/completions",
        json={"messages": user, "stop": ["a", "b"], "logprobs": True, "top_logprobs": 2, "max_tokens": 2},
    )
    assert ok.status_code == 200, ok.text


def test_a_client_that_leaves_mid_body_is_no_error(tokenizer, caplog):
    app = app_with(tokenizer)
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b'{"messages": [', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert json.loads(sent[1]["body"])["error"]["type"] == "ClientClosedRequest"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_content_length_that_is_not_a_number_is_refused(tokenizer):
    app = app_with(tokenizer)
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-length", b"lots")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 400 and b"Content-Length" in sent[1]["body"]
