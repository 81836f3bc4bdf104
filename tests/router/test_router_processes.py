"""Pieces of several router processes that need no Ray: the admission shares, the shared port
(SO_REUSEPORT) and the x-baton-router header."""

from __future__ import annotations

import socket

import pytest
from fastapi.testclient import TestClient

from router.admission import share_of
from router.app import ROUTER_HEADER, bind_socket, build_app
from router.testing import FakeBackend
from router.tokenizer import Tokenizer
from workers.model_files import resolve_model_dir


@pytest.mark.parametrize("total, routers", [(128, 1), (128, 3), (7, 4), (64, 64)])
def test_the_shares_add_up_to_what_one_router_admits(total, routers):
    shares = [share_of(total, routers, i) for i in range(routers)]
    assert sum(shares) == total and max(shares) - min(shares) <= 1


def test_every_router_gets_a_slot_and_no_limit_stays_no_limit():
    assert [share_of(2, 4, i) for i in range(4)] == [1, 1, 1, 1]
    assert share_of(None, 4, 2) is None
    with pytest.raises(ValueError, match="out of range"):
        share_of(8, 2, 2)


def test_two_sockets_share_a_port_with_reuse_port_and_a_plain_holder_refuses_them():
    first = bind_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    second = bind_socket("127.0.0.1", port, reuse_port=True)
    assert second.getsockname()[1] == port
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    with pytest.raises(ValueError, match="cannot listen on 127.0.0.1"):
        bind_socket("127.0.0.1", plain.getsockname()[1], reuse_port=True)
    for s in (first, second, plain):
        s.close()


def test_every_response_names_its_router_even_an_error():
    tokenizer = Tokenizer.from_model_dir(resolve_model_dir(quiet=True))
    app = build_app(FakeBackend(tokenizer), tokenizer, "fake", 4096, router_id="router-3.1")
    with TestClient(app) as client:
        assert client.get("/health").headers[ROUTER_HEADER] == "router-3.1"
        bad = client.post("/v1/chat/completions", json={"messages": []})
        assert bad.status_code == 400 and bad.headers[ROUTER_HEADER] == "router-3.1"
