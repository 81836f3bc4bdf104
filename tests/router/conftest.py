"""Fixtures for the router tests: the default model's tokenizer, a FakeBackend, an app, a live server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from router.app import build_app
from router.tokenizer import Tokenizer
from testkit.backend import FakeBackend
from testkit.harness import serve_app
from workers.models.files import resolve_model_dir

MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 8192


@pytest.fixture(scope="session")
def model_dir():
    try:
        return resolve_model_dir(None, quiet=True)
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"default model not available: {e}")


@pytest.fixture(scope="session")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture
def backend(tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer)


@pytest.fixture
def make_client(tokenizer):
    """make_client(backend=None, max_model_len=..., policy=None) -> TestClient."""

    def make(backend: FakeBackend | None = None, max_model_len: int = MAX_MODEL_LEN, policy=None) -> TestClient:
        be = backend or FakeBackend(tokenizer)
        app = build_app(be, tokenizer, MODEL_NAME, max_model_len, policy)
        return TestClient(app, raise_server_exceptions=False)

    return make


@pytest.fixture
def client(make_client, backend) -> TestClient:
    return make_client(backend)


@contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1:<free port> in a thread (testkit.harness.serve_app); yield the base URL."""
    with serve_app(app) as served:
        yield served.base_url


@pytest.fixture
def live_server(tokenizer):
    """live_server(backend) -> context manager yielding the base URL of a real uvicorn server."""

    def start(backend: FakeBackend, max_model_len: int = MAX_MODEL_LEN):
        return running_server(build_app(backend, tokenizer, MODEL_NAME, max_model_len))

    return start
