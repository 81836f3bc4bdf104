"""The bad-request corpus (tests/hardening/corpus.py) against the router over a FakeBackend.

Fast and Ray-free: every case must get its status, the OpenAI envelope and the field named, the
router must stay healthy, and the next good request must get the fake backend's scripted reply
(the oracle: the reply's first tokens, decoded by the tokenizer). tests/hardening/test_corpus.py
sends the same corpus to a real deployment.
"""

from __future__ import annotations

import pytest

from router.app import build_app
from router.config import ServerConfig
from testkit.backend import FakeBackend
from tests.hardening.corpus import API_KEY, MAX_REQUEST_BODY, check_answer, corpus, send
from tests.router.conftest import MAX_MODEL_LEN, MODEL_NAME

CASES = corpus(MAX_MODEL_LEN)
GOOD = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6, "temperature": 0}


def test_the_corpus_is_large_and_covers_every_endpoint():
    assert len(CASES) >= 50
    paths = {c.path for c in CASES}
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/version",
        "/metrics",
        "/v1/status",
        "/dashboard",
    } <= paths


@pytest.fixture(scope="module")
def served(tokenizer):
    from fastapi.testclient import TestClient

    backend = FakeBackend(tokenizer)
    app = build_app(
        backend,
        tokenizer,
        MODEL_NAME,
        MAX_MODEL_LEN,
        server=ServerConfig(api_key=API_KEY, max_request_body=MAX_REQUEST_BODY),
    )
    return TestClient(app, raise_server_exceptions=False), backend


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_then_healthy_and_a_good_answer(case, served, tokenizer):
    client, backend = served
    before = len(backend.requests)
    check_answer(case, send(client, case))
    assert len(backend.requests) == before, "a refused request reached the backend"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json=GOOD, headers=auth)
    assert r.status_code == 200, r.text
    expected = tokenizer.decode(backend.reply_ids[:6])
    assert r.json()["choices"][0]["message"]["content"] == expected
    assert client.app.state.baton.admission.state()["decode"]["running"] == 0
