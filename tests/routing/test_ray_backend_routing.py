"""RayBackend + KvAwarePolicy over fake actors: KV events reach the index, dead workers leave it,
short uncached prompts prefill locally and long ones remotely (counters, traces, /metrics)."""

from __future__ import annotations

import asyncio
import time

from common.block_hash import hash_prefix_blocks
from common.sampling_params import SamplingParams
from router.pools import WorkerPools
from router.ray_backend import RayBackend
from router.routing import KvAwarePolicy, RoutingConfig
from router.trace import RequestTrace

from .fake_actors import BS, FakeActor, _Method, make_request

HEALTH_S = 0.1


def make_backend(num_prefill=2, num_decode=1):
    actors = {f"prefill-{i}": FakeActor(f"prefill-{i}", "prefill") for i in range(num_prefill)}
    actors.update({f"decode-{i}": FakeActor(f"decode-{i}", "decode") for i in range(num_decode)})
    backend = RayBackend(
        WorkerPools(list(actors.values()), health_interval_s=HEALTH_S, health_timeout_s=1.0, poll_timeout_s=0.02)
    )
    return backend, actors


async def run(backend, policy, prompt, rid):
    route = policy.choose(prompt, backend.workers())
    trace = RequestTrace(rid, len(prompt))
    trace.set_route(route)
    outs = [o async for o in backend.generate(make_request(rid, prompt, SamplingParams(max_tokens=2), route, trace))]
    assert outs[-1].finished
    return route, trace


def test_dead_worker_leaves_the_index_within_a_health_interval_and_gets_nothing():
    async def main():
        backend, actors = make_backend()
        policy = KvAwarePolicy(backend.prefix_index, BS, RoutingConfig(seed=0, local_prefill_threshold=0))
        try:
            backend.workers()  # starts the health loop and the pumps
            prompt = list(range(100, 400))
            route, _ = await run(backend, policy, prompt, "r0")
            holder = route.prefill_worker
            hashes = hash_prefix_blocks(prompt[:-1], BS)
            deadline = time.monotonic() + 2.0
            while backend.prefix_index.match(hashes).get(holder, 0) != len(hashes):
                assert time.monotonic() < deadline, "the KV events never reached the index"
                await asyncio.sleep(0.02)
            # The same prompt again goes to the holder (cache affinity, through real events).
            route2, trace2 = await run(backend, policy, prompt, "r1")
            assert route2.prefill_worker == holder and trace2.cached_tokens == len(hashes) * BS
            assert route2.cached_blocks == len(hashes)

            actors[holder].kill()
            calls_before = len(actors[holder].calls)
            killed_at = time.monotonic()
            while holder in backend.prefix_index.workers():
                await asyncio.sleep(0.01)
            assert time.monotonic() - killed_at <= HEALTH_S + 0.3  # one health interval (plus scheduling slack)
            assert [w.alive for w in backend.workers() if w.worker_id == holder] == [False]
            other = next(w for w in actors if w.startswith("prefill") and w != holder)
            for i in range(10):
                route, _ = await run(backend, policy, prompt, f"after-{i}")
                assert route.prefill_worker == other
            assert set(actors[holder].calls[calls_before:]) <= {"heartbeat"}  # only health checks were tried
            assert actors[other].calls.count("prefill") >= 10
        finally:
            await backend.close()

    asyncio.run(main())


def test_restarted_worker_loses_its_index_entries():
    async def main():
        backend, actors = make_backend(num_prefill=1)
        try:
            a = actors["prefill-0"]
            a._compute(list(range(200)))  # the worker cached a prompt and queued the STORED event
            await backend.pools.refresh_stats()
            assert backend.prefix_index.num_blocks("prefill-0") == 12
            a.pid += 1  # restarted: an empty cache, and no event says so
            await backend.pools.refresh_stats()
            assert backend.prefix_index.num_blocks("prefill-0") == 0
        finally:
            await backend.close()

    asyncio.run(main())


def test_short_uncached_prompts_prefill_locally_and_long_ones_remotely():
    async def main():
        backend, actors = make_backend()
        policy = KvAwarePolicy(backend.prefix_index, BS, RoutingConfig(seed=0, local_prefill_threshold=64))
        try:
            backend.workers()
            traces = []
            for i in range(5):
                traces.append((await run(backend, policy, [5000 + 10 * i + k for k in range(20 + i)], f"short-{i}"))[1])
            for i in range(3):
                traces.append((await run(backend, policy, [9000 + 1000 * i + k for k in range(400)], f"long-{i}"))[1])
            assert backend.counters["local_prefill"] == 5
            assert backend.counters["remote_prefill"] == 3
            assert [t.decision for t in traces] == ["local"] * 5 + ["remote"] * 3
            assert {t.reason for t in traces[:5]} == {"local_short_uncached"}
            assert all(t.kv_bytes == 3 * 4096 and t.transfer_s > 0 for t in traces[5:])
            assert all(t.kv_bytes == 0 and t.prefill_worker is None for t in traces[:5])
            assert sum(a.calls.count("submit") for a in actors.values()) == 5
            # Queued prefill tokens go back to zero once every request had its first token.
            assert all(w.queued_prefill_tokens == 0 for w in backend.workers())
        finally:
            await backend.close()

    asyncio.run(main())


def test_counters_through_the_http_app(tokenizer):
    """The same through the router app: /metrics counts the routing decisions by reason."""
    from fastapi.testclient import TestClient

    from router.app import build_app

    backend, _ = make_backend()
    policy = KvAwarePolicy(backend.prefix_index, BS, RoutingConfig(seed=0, local_prefill_threshold=64))
    app = build_app(backend, tokenizer, "m", 8192, policy)
    with TestClient(app) as client:
        short = client.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2})
        long = client.post("/v1/completions", json={"prompt": "word " * 300, "max_tokens": 2})
        assert short.status_code == 200 and long.status_code == 200
        text = client.get("/metrics").text
        assert (
            'baton:routing_decisions_total{decision="local",model_name="m",reason="local_short_uncached"} 1.0' in text
        )
        assert 'baton:routing_decisions_total{decision="remote",model_name="m",reason="remote_prefill"} 1.0' in text
        client.portal.call(backend.close)
    assert backend.counters["local_prefill"] == 1 and backend.counters["remote_prefill"] == 1


def test_a_finished_first_token_frees_the_reservation_when_the_consumer_stops_at_it():
    # The non-streaming path (Serving._collect) closes the stream as soon as every choice has
    # finished: the Abort of D's reservation that follows the finished first token must still run.
    async def main():
        backend, actors = make_backend(num_prefill=1)
        d = actors["decode-0"]
        policy = KvAwarePolicy(backend.prefix_index, BS, RoutingConfig(seed=0, local_prefill_threshold=0))
        try:
            backend.workers()
            prompt = [9000 + k for k in range(40)]
            route = policy.choose(prompt, backend.workers())
            assert route.prefill_worker == "prefill-0"
            outputs = backend.generate(make_request("one", prompt, SamplingParams(max_tokens=1), route))
            first = await outputs.__anext__()
            assert first.finished
            await outputs.aclose()
            deadline = time.monotonic() + 2.0
            while d.reserved or d.calls.count("abort") != 1:
                assert time.monotonic() < deadline, (d.reserved, d.calls)
                await asyncio.sleep(0.02)
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_remote_prefills_first_token_does_not_wait_for_the_decode_worker():
    # D answers start_decode and abort 0.5 s late (inside a long engine step): the first token
    # reaches the client as soon as P returns it; the rest follows once D has started.
    async def main():
        backend, actors = make_backend(num_prefill=1)
        d = actors["decode-0"]

        def half_a_second_late(fn):
            async def late(*args):
                await asyncio.sleep(0.5)
                return await fn(*args)

            return late

        for name in ("start_decode", "abort"):
            late = half_a_second_late(getattr(d, "_" + name))
            late.__name__ = name  # as the calls log names it
            setattr(d, name, _Method(d, late))
        policy = KvAwarePolicy(backend.prefix_index, BS, RoutingConfig(seed=0, local_prefill_threshold=0))
        try:
            backend.workers()
            for max_tokens in (1, 3):
                prompt = [7000 + 100 * max_tokens + k for k in range(40)]
                route = policy.choose(prompt, backend.workers())
                assert route.prefill_worker == "prefill-0"
                started, times = time.perf_counter(), []
                async for _out in backend.generate(
                    make_request(f"r{max_tokens}", prompt, SamplingParams(max_tokens=max_tokens), route)
                ):
                    times.append(time.perf_counter() - started)
                assert times[0] < 0.3, times  # not behind D's 0.5 s
                if max_tokens > 1:
                    assert times[-1] > 0.5  # the decode worker's tokens came after its start
            await asyncio.sleep(0.6)  # the one-token request's reservation is freed beside its answer
            assert not d.reserved and d.calls.count("abort") == 1
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_burst_counts_the_prompts_routed_before_it_against_the_prefill_queue_threshold(tokenizer):
    """Requests that arrive together are routed before any of them starts in the pools. Each must
    still count the prompts routed before it as queued on their prefill worker: with a 1-prefill
    pool and a threshold of about two prompts, a burst of 8 sends 2 to the prefill worker and
    prefills the other 6 on the decode worker (`local_prefill_busy`), not all 8 remotely."""
    import httpx

    from router.app import build_app

    actors = {
        "prefill-0": FakeActor("prefill-0", "prefill", prefill_delay_s=0.3),
        "decode-0": FakeActor("decode-0", "decode"),
    }
    backend = RayBackend(
        WorkerPools(list(actors.values()), health_interval_s=HEALTH_S, health_timeout_s=1.0, poll_timeout_s=0.02)
    )
    prompt = "word " * 300
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=True))
    policy = KvAwarePolicy(
        backend.prefix_index,
        BS,
        RoutingConfig(seed=0, local_prefill_threshold=0, prefill_queue_threshold=prompt_len + prompt_len // 2),
    )
    app = build_app(backend, tokenizer, "m", 8192, policy)

    async def main():
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
                replies = await asyncio.gather(
                    *(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}) for _ in range(8))
                )
            assert [r.status_code for r in replies] == [200] * 8
            assert backend.counters["remote_prefill"] == 2 and backend.counters["local_prefill"] == 6
            assert all(w.queued_prefill_tokens == 0 for w in backend.workers())
        finally:
            await backend.close()

    asyncio.run(main())
