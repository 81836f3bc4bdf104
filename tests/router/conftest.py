"""Fixtures for the router tests: the default model's tokenizer, a FakeBackend, an app, a live server."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from router.app import build_app, make_server
from router.tokenizer import Tokenizer
from tests.fakes import FakeBackend
from workers.model_files import resolve_model_dir

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1:<free port> in a thread; yield the base URL."""
    port = free_port()
    server = make_server(app, host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def live_server(tokenizer):
    """live_server(backend) -> context manager yielding the base URL of a real uvicorn server."""

    def start(backend: FakeBackend, max_model_len: int = MAX_MODEL_LEN):
        return running_server(build_app(backend, tokenizer, MODEL_NAME, max_model_len))

    return start
