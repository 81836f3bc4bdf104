"""Pieces of several router processes that need no Ray: the admission shares, the shared port
(SO_REUSEPORT), the x-baton-router header, a router following the worker set router 0 publishes
(cluster.membership, over fake worker actors) and admin requests forwarded to router 0."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.membership import Member, Membership, MembershipFollower, WorkerDirectory, changes
from router.admin import install_admin, install_admin_forwarding
from router.admission import share_of
from router.app import ROUTER_HEADER, bind_socket, build_app
from router.config import ADMIN_TOKEN_HEADER, AdminConfig, ServerConfig
from router.errors import install_error_handlers
from router.pools import WorkerPools
from router.ray_backend import RayBackend
from router.tokenizer import Tokenizer
from testkit.backend import FakeBackend
from testkit.harness import serve_app
from tests.healing.test_admin_endpoint import LOCAL, REMOTE, RecordingScaler
from tests.routing.fake_actors import FakeActor
from tests.routing.test_migration import STEP_S, assert_exact, prompt_of, stream, wait_for
from tests.routing.test_pool_manager import fake_ray, make_deployment  # noqa: F401 (fake_ray: a fixture)
from workers.models.files import resolve_model_dir


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


def members(*spec: tuple[str, bool]) -> tuple[Member, ...]:
    return tuple(Member(wid, wid.split("-")[0], f"test-{wid}", draining) for wid, draining in spec)


def test_changes_add_serving_workers_drain_what_router_0_drains_and_drop_the_rest():
    published = Membership(
        4, 1, 2, members(("prefill-0", False), ("decode-0", True), ("decode-2", False), ("decode-3", True))
    )
    todo = changes({"prefill-0": False, "decode-0": False, "decode-1": False}, published)
    assert [m.worker_id for m in todo.add] == ["decode-2"]  # decode-3: draining, never worth adding
    assert todo.drain == ("decode-0",) and todo.remove == ("decode-1",)
    assert changes({"decode-0": True}, published).drain == ()  # already draining here
    with pytest.raises(ValueError):
        Membership(1, 1, 1, (Member("x-0", "encode", "test-x-0"),))


def test_the_directory_keeps_the_newest_version_only():
    directory = WorkerDirectory()
    assert directory.read() is None
    newer, older = Membership(3, 1, 2, members(("decode-0", False))), Membership(2, 1, 1, ())
    directory.publish(newer)
    directory.publish(older)  # late: ignored
    assert directory.read(0) is newer and directory.read(3) is None


def test_a_follower_adds_drains_and_removes_workers_as_router_0_publishes():
    """Router 1's pools over fake actors follow three versions: decode-1 added (a request routed
    to it streams exactly, the lease loop renews on it), then drained (its stream moves to
    decode-0 and still ends exactly), then removed; the gates hear each new target."""

    async def main():
        actors = {
            a.worker_id: a
            for a in (
                FakeActor("prefill-0", "prefill", prefill_delay_s=0.01),
                FakeActor("decode-0", "decode", step_s=STEP_S),
                FakeActor("decode-1", "decode", step_s=STEP_S),
            )
        }
        pools = WorkerPools(
            [actors["prefill-0"], actors["decode-0"]], health_interval_s=0.05, health_timeout_s=0.5, poll_timeout_s=0.02
        )
        backend = RayBackend(pools)
        published: list[Membership] = []
        targets: list[tuple[int, int]] = []

        async def read(known: int):
            newer = [m for m in published if m.version > known]
            return newer[-1] if newer else None

        async def resolve(name: str):
            return actors[name.removeprefix("test-")]

        follower = MembershipFollower(
            pools,
            "test",
            "ns",
            drain_timeout_s=0.2,
            every_s=0.02,
            on_targets=lambda p, d: targets.append((p, d)),
            read=read,
            resolve=resolve,
        )
        running = asyncio.create_task(follower.run())
        try:
            backend.workers()
            published.append(
                Membership(1, 1, 2, members(("prefill-0", False), ("decode-0", False), ("decode-1", False)))
            )
            await wait_for(lambda: "decode-1" in {w.worker_id for w in pools.workers()})
            assert_exact(await stream(backend, "a", prompt_of(1), 8, "decode-1", "prefill-0"), prompt_of(1), 8)
            assert "submit" in actors["decode-1"].calls or "start_decode" in actors["decode-1"].calls
            await wait_for(lambda: actors["decode-1"].renewed > 0)
            # A long stream on decode-1, then router 0 drains it: the stream moves and ends exactly.
            long = asyncio.create_task(stream(backend, "b", prompt_of(2), 80, "decode-1", "prefill-0"))
            await wait_for(lambda: len(actors["decode-1"].running) == 1)
            published.append(
                Membership(2, 1, 1, members(("prefill-0", False), ("decode-0", False), ("decode-1", True)))
            )
            await wait_for(lambda: any(w.draining for w in pools.workers() if w.worker_id == "decode-1"))
            assert_exact(await long, prompt_of(2), 80)
            assert actors["decode-0"].submitted[-1][0] == "b"  # resumed on decode-0
            published.append(Membership(3, 1, 1, members(("prefill-0", False), ("decode-0", False))))
            await wait_for(lambda: follower.version == 3)
            assert {w.worker_id for w in pools.workers()} == {"prefill-0", "decode-0"}
            assert targets == [(1, 2), (1, 1)]
            assert not actors["decode-1"].stopped  # router 0 stops it, not a follower
        finally:
            running.cancel()
            await pools.close()

    asyncio.run(main())


def router0_admin(config: AdminConfig, scaler: RecordingScaler) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_admin(app, scaler, config)
    return app


def router1_app(tokenizer, config: AdminConfig, router0_url: str, api_key: str | None = None) -> FastAPI:
    app = build_app(
        FakeBackend(tokenizer), tokenizer, "m", 1024, server=ServerConfig(api_key=api_key), router_id="router-1.0"
    )
    install_admin_forwarding(app, config, router0_url, timeout_s=10)
    return app


def test_admin_requests_to_another_router_are_forwarded_to_router_0_with_the_same_checks(tokenizer):
    scaler = RecordingScaler()
    config = AdminConfig(enabled=True)
    with serve_app(router0_admin(config, scaler)) as router0:
        url = f"http://127.0.0.1:{router0.port}"
        with TestClient(router1_app(tokenizer, config, url), client=REMOTE) as client:
            # Router 0 sees the forwarding router on loopback: router 1 applies the rule to the client.
            refused = client.post("/admin/scale", json={"decode": 2})
            assert refused.status_code == 403 and "loopback" in refused.json()["error"]["message"]
            assert refused.headers[ROUTER_HEADER] == "router-1.0"
        assert scaler.calls == []
        with TestClient(router1_app(tokenizer, config, url), client=LOCAL) as client:
            done = client.post("/admin/scale", json={"decode": 2})
            assert done.status_code == 200 and done.headers[ROUTER_HEADER] == "router-1.0"
            assert done.json()["after"] == {"prefill": 1, "decode": 2} and done.json()["added"] == ["decode-1"]
            assert client.get("/admin/pools").json()["decode"] == 2
            bad = client.post("/admin/scale", json={"decode": -1})  # router 0's refusal, passed on as it is
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "decode"
            assert client.get("/admin/nothing").status_code == 404
        assert scaler.calls == [(None, 2)]
    # Router 0 gone: a clear 502, not a hang.
    with TestClient(router1_app(tokenizer, config, url), client=LOCAL) as client:
        gone = client.get("/admin/pools")
        assert gone.status_code == 502 and "router 0" in gone.json()["error"]["message"]


def test_forwarding_keeps_the_token_and_the_api_key(tokenizer):
    scaler = RecordingScaler()
    config = AdminConfig(enabled=True, token="tok")
    router0 = router0_admin(config, scaler)
    with serve_app(router0) as served:
        app = router1_app(tokenizer, config, f"http://127.0.0.1:{served.port}", api_key="key-1")
        with TestClient(app, client=REMOTE) as client:
            key = {"authorization": "Bearer key-1"}
            assert (
                client.post("/admin/scale", json={"decode": 2}, headers={ADMIN_TOKEN_HEADER: "tok"}).status_code == 401
            )
            assert client.post("/admin/scale", json={"decode": 2}, headers=key).status_code == 401
            ok = client.post("/admin/scale", json={"decode": 2}, headers={**key, ADMIN_TOKEN_HEADER: "tok"})
            assert ok.status_code == 200
        assert scaler.calls == [(None, 2)]
    assert TestClient(FastAPI()).get("/admin/pools").status_code == 404
    off = router1_app(tokenizer, AdminConfig(), "http://127.0.0.1:9")
    with TestClient(off, client=LOCAL) as client:
        assert client.get("/admin/pools").status_code == 404  # the endpoint off: no forwarding either


def test_the_pool_managers_changes_reach_a_second_routers_pools(fake_ray):  # noqa: F811 (pytest injects the fixture imported above)
    """Router 0's PoolManager (fake Ray) publishes into a WorkerDirectory; a second router's pools
    over the same fake actors follow it: decode-1 appears after the scale-up, is published
    draining before it is drained, and disappears after the scale-down."""

    async def main():
        deployment, actors = make_deployment()
        directory = WorkerDirectory()
        seen: list[Membership] = []
        deployment.pools.subscribe_membership(lambda m: (seen.append(m), directory.publish(m)))
        workers = {w.worker_id: w.handle for w in deployment.workers}
        other = WorkerPools([w for w in deployment.workers], health_interval_s=0.05, poll_timeout_s=0.02)

        async def read(known: int):
            return directory.read(known)

        async def resolve(name: str):
            return next(w.handle for w in deployment.workers if w.actor_name == name)

        follower = MembershipFollower(
            other, "test", "ns", drain_timeout_s=0.1, every_s=0.02, read=read, resolve=resolve
        )
        running = asyncio.create_task(follower.run())
        try:
            deployment.backend.workers()
            await deployment.pools.scale(decode=2)
            await wait_for(lambda: "decode-1" in {w.worker_id for w in other.workers()})
            assert seen[-1].decode_target == 2 and {m.worker_id for m in seen[-1].members} == {*workers, "decode-1"}
            await deployment.pools.scale(decode=1)
            draining = [m for m in seen if any(x.draining for x in m.members)]
            assert [x.worker_id for x in draining[0].members if x.draining] == ["decode-1"]
            await wait_for(lambda: {w.worker_id for w in other.workers()} == set(workers))
            assert [m.version for m in seen] == list(range(1, len(seen) + 1))
        finally:
            running.cancel()
            await other.close()
            await deployment.backend.close()

    asyncio.run(main())
