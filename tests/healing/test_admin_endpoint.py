"""The admin endpoint and `baton scale`, over a recording stand-in for the pool manager (no Ray):
off by default, loopback only without a token, the token required from everyone with one, API keys
still enforced on top, bad sizes refused with 400, one scaling at a time, and the CLI's requests
and output against a real HTTP server."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.cli import main as cli_main
from router.admin import PoolsView, ScaleResult, install_admin
from router.app import build_app
from router.backend import WorkerInfo
from router.config import ADMIN_TOKEN_HEADER, AdminConfig, ServerConfig
from router.errors import install_error_handlers
from testkit.backend import FakeBackend
from testkit.harness import serve_app

LOCAL = ("127.0.0.1", 40000)
REMOTE = ("10.1.2.3", 40000)


class RecordingScaler:
    """Answers like cluster.pool_manager.PoolManager; records every scaling."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.sizes = {"prefill": 1, "decode": 1}
        self.calls: list[tuple[int | None, int | None]] = []
        self.delay_s = delay_s

    def pools(self) -> PoolsView:
        return PoolsView(
            self.sizes["prefill"],
            self.sizes["decode"],
            [WorkerInfo("prefill-0", "prefill", in_flight=0), WorkerInfo("decode-0", "decode", running=2, in_flight=2)],
        )

    async def scale(self, prefill, decode) -> ScaleResult:
        self.calls.append((prefill, decode))
        await asyncio.sleep(self.delay_s)
        if decode == 0:
            raise ValueError("the decode pool needs at least 1 worker, got 0")
        before = dict(self.sizes)
        self.sizes = {
            "prefill": before["prefill"] if prefill is None else prefill,
            "decode": before["decode"] if decode is None else decode,
        }
        return ScaleResult(before, dict(self.sizes), ["decode-1"], [], 0, 0.5)


def app_with(config: AdminConfig, scaler=None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_admin(app, scaler or RecordingScaler(), config)
    return app


def test_off_by_default_and_loopback_only_without_a_token():
    assert AdminConfig().enabled is False
    with TestClient(app_with(AdminConfig()), client=LOCAL) as client:
        assert client.get("/admin/pools").status_code == 404
        assert client.post("/admin/scale", json={"decode": 2}).status_code == 404
    scaler = RecordingScaler()
    with TestClient(app_with(AdminConfig(enabled=True), scaler), client=REMOTE) as client:
        r = client.post("/admin/scale", json={"decode": 2})
        assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]
    with TestClient(app_with(AdminConfig(enabled=True), scaler), client=LOCAL) as client:
        worker = client.get("/admin/pools").json()["workers"][1]
        assert {k: worker[k] for k in ("worker_id", "role", "alive", "draining", "in_flight", "running")} == {
            "worker_id": "decode-0",
            "role": "decode",
            "alive": True,
            "draining": False,
            "in_flight": 2,
            "running": 2,
        }
        r = client.post("/admin/scale", json={"decode": 2})
        assert r.status_code == 200 and r.json()["after"] == {"prefill": 1, "decode": 2}
    assert scaler.calls == [(None, 2)]


def test_a_token_is_required_from_every_client_once_set():
    scaler = RecordingScaler()
    app = app_with(AdminConfig(enabled=True, token="s3cret"), scaler)
    for address in (LOCAL, REMOTE):
        with TestClient(app, client=address) as client:
            assert client.post("/admin/scale", json={"decode": 2}).status_code == 401
            wrong = client.post("/admin/scale", json={"decode": 2}, headers={ADMIN_TOKEN_HEADER: "guess"})
            assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
            ok = client.post("/admin/scale", json={"decode": 2}, headers={ADMIN_TOKEN_HEADER: "s3cret"})
            assert ok.status_code == 200
    assert scaler.calls == [(None, 2), (None, 2)]
    assert "s3cret" not in repr(AdminConfig(enabled=True, token="s3cret"))
    assert AdminConfig().with_token_from_env({"BATON_ADMIN_TOKEN": " t "}).token == "t"
    assert AdminConfig(token="mine").with_token_from_env({"BATON_ADMIN_TOKEN": "t"}).token == "mine"


def test_bad_requests_and_one_scaling_at_a_time():
    scaler = RecordingScaler(delay_s=0.3)
    with TestClient(app_with(AdminConfig(enabled=True), scaler), client=LOCAL) as client:
        for body, param in (({"decode": -1}, "decode"), ({"prefill": "2"}, "prefill"), ({"decode": True}, "decode")):
            r = client.post("/admin/scale", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert client.post("/admin/scale", json={"replicas": 3}).status_code == 400
        assert client.post("/admin/scale", content=b"{nope").status_code == 400
        refused = client.post("/admin/scale", json={"decode": 0})  # the scaler's own refusal
        assert refused.status_code == 400 and "at least 1" in refused.json()["error"]["message"]
        results = {}

        def post(name, body):
            results[name] = client.post("/admin/scale", json=body)

        threads = [threading.Thread(target=post, args=(n, {"decode": 3})) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.status_code for r in results.values()) == [200, 409]
    assert scaler.calls == [(None, 0), (None, 3)]


def test_api_keys_still_apply_and_the_cli_speaks_to_a_real_server(tokenizer, capsys, monkeypatch):
    scaler = RecordingScaler()
    app = build_app(FakeBackend(tokenizer), tokenizer, "m", 1024, server=ServerConfig(api_key="key-1"))
    install_admin(app, scaler, AdminConfig(enabled=True, token="tok"))
    monkeypatch.delenv("BATON_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    with serve_app(app) as served:
        url = served.base_url
        assert cli_main(["scale", "--url", url, "--decode", "3", "--admin-token", "tok"]) == 1
        assert "401" in capsys.readouterr().err  # no API key: refused before the admin check
        assert cli_main(["scale", "--url", url, "--decode", "3", "--api-key", "key-1"]) == 1
        assert "admin token" in capsys.readouterr().err
        monkeypatch.setenv("BATON_ADMIN_TOKEN", "tok")
        monkeypatch.setenv("BATON_API_KEY", "key-1")
        assert cli_main(["scale", "--url", url, "--decode", "3", "--prefill", "0"]) == 0
        out = capsys.readouterr().out
        assert "prefill 1 -> 0, decode 1 -> 3" in out and "started: decode-1" in out
        assert cli_main(["scale", "--url", url]) == 0
        assert "decode-0" in capsys.readouterr().out
        assert cli_main(["scale", "--url", url, "--decode", "0"]) == 1
        assert "at least 1" in capsys.readouterr().err
        assert scaler.calls == [(0, 3), (None, 0)]
    assert cli_main(["scale", "--url", url, "--decode", "2"]) == 1
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["scale", "--decode", "x"]])
def test_scale_flags_are_checked(argv):
    with pytest.raises(SystemExit):
        cli_main(argv)
