"""Healing and scaling on a real deployment (Ray on 127.0.0.1, 2 prefill + 2 decode workers,
the router over HTTP): bounded fault tests and scaling under load.

Faults are real: a worker's process is SIGKILLed (as a crash or the OOM killer would), during 32
concurrent streaming requests. Oracle: the engine alone, greedy float32 (tests/healing/helpers.py).
Each test checks that every request completed with exactly that answer or ended with a clean
error, that none outlived its deadline, that no worker holds a block once idle (nothing leaked),
that Ray's restart brought the pool back to its size, and that the restarted worker serves again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import BatonConfig
from common.worker_client import WorkerClient
from testkit.cluster import leave_ray, serving
from testkit.harness import free_port, wait_until
from tests.healing.helpers import Load, check_results, kill_when_running, run_load, wait_async

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
DEADLINE_S = 180.0  # the server's request_timeout: generous, this machine may be shared


@pytest.fixture(scope="module")
def deployment():
    # Round-robin: each pool's requests split evenly, so a killed worker always had half of them.
    # local_prefill_threshold=0: every request crosses a prefill worker and the KV transfer.
    config = BatonConfig.from_options(
        port=free_port(),
        prefill_workers=2,
        decode_workers=2,
        kv_cache_memory="64MiB",
        max_num_seqs=32,
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
        routing_policy="round-robin",
        request_timeout=DEADLINE_S,
        admin_endpoint=True,
        drain_timeout=2.0,
        max_restarts=2,
    )
    leave_ray()  # a private Ray of this module's own, which the deployment shuts down after it
    with serving(config, actor_name_prefix="heal") as running:
        yield running


def handle(running, worker_id: str):
    return next(w.handle for w in running.deployment.workers if w.worker_id == worker_id)


def pid_of(running, worker_id: str) -> int:
    return ray.get(WorkerClient(handle(running, worker_id)).stats(), timeout=60).pid


def pools_whole(running, size: int = 4) -> bool:
    infos = running.deployment.backend.workers()
    return len(infos) == size and all(w.alive and not w.draining for w in infos)


def assert_idle_and_leak_free(running) -> None:
    """Every worker, restarted ones included, ends with no request and no referenced block."""
    stats = running.wait_idle(timeout_s=60)
    for wid, s in stats.items():
        assert s.num_running == 0 and s.num_waiting == 0, (wid, s)
        assert s.num_free_blocks == s.num_blocks, f"{wid} leaked {s.num_blocks - s.num_free_blocks} blocks"


def serve_again(running, expected, worker_id: str) -> None:
    """A round of requests after the pool healed: exact answers, and the restarted worker takes part."""
    before = ray.get(WorkerClient(handle(running, worker_id)).stats(), timeout=60)
    load = asyncio.run(run_load(running.base_url, expected[:8], _nothing, DEADLINE_S))
    counts = check_results(load.results, expected[:8], DEADLINE_S)
    assert counts["exact"] == 8, counts
    after = ray.get(WorkerClient(handle(running, worker_id)).stats(), timeout=60)
    assert after.generation_tokens + after.prompt_tokens > before.generation_tokens + before.prompt_tokens


async def _nothing(load) -> None:
    return None


def test_killing_a_decode_worker_mid_stream_loses_no_request(deployment, clear_prompt_set):
    expected = clear_prompt_set(32, MAX_TOKENS)
    backend = deployment.deployment.backend
    wait_until(lambda: pools_whole(deployment), 120, "every worker up")
    old_pid = pid_of(deployment, "decode-0")
    migrations = backend.counters["migrations"]

    async def kill_mid_stream(load):
        await kill_when_running(handle(deployment, "decode-0"), [old_pid])

    load = asyncio.run(run_load(deployment.base_url, expected, kill_mid_stream, DEADLINE_S + 30))
    counts = check_results(load.results, expected, DEADLINE_S)
    moved = backend.counters["migrations"] - migrations
    # decode-0's streams were mid-answer when it died: each one moved and still ended exactly.
    assert counts["exact"] == 32 and moved >= 1, (counts, moved)
    # Operators see the moves: the router's /metrics counts them.
    exported = {
        sample.labels["event"]: sample.value
        for family in text_string_to_metric_families(httpx.get(deployment.base_url + "/metrics").text)
        if family.name == "baton:healing_events"
        for sample in family.samples
    }
    assert exported["migrations"] == backend.counters["migrations"] >= moved, exported

    wait_until(lambda: pools_whole(deployment), 180, "Ray to restart decode-0 and the router to re-admit it")
    assert pid_of(deployment, "decode-0") != old_pid
    assert_idle_and_leak_free(deployment)
    serve_again(deployment, expected, "decode-0")


def test_killing_a_prefill_worker_mid_prefill_loses_no_request(deployment, clear_prompt_set):
    expected = clear_prompt_set(32, MAX_TOKENS)
    backend = deployment.deployment.backend
    wait_until(lambda: pools_whole(deployment), 180, "every worker up")
    old_pid = pid_of(deployment, "prefill-0")
    retries, fallbacks = backend.counters["prefill_retries"], backend.counters["local_prefill"]

    async def kill_while_prefilling(load):
        await wait_async(lambda: backend.pools.in_flight("prefill-0") >= 4, 120, "prefills on prefill-0", every_s=0.005)
        os.kill(old_pid, signal.SIGKILL)

    load = asyncio.run(run_load(deployment.base_url, expected, kill_while_prefilling, DEADLINE_S + 30))
    counts = check_results(load.results, expected, DEADLINE_S)
    assert counts["exact"] == 32, counts
    # The prefills caught on prefill-0 went to prefill-1 (or, racing the health check, to their decode worker).
    assert backend.counters["prefill_retries"] - retries + backend.counters["local_prefill"] - fallbacks >= 1

    wait_until(lambda: pools_whole(deployment), 180, "Ray to restart prefill-0 and the router to re-admit it")
    assert pid_of(deployment, "prefill-0") != old_pid
    assert_idle_and_leak_free(deployment)
    serve_again(deployment, expected, "prefill-0")


def test_a_worker_dead_for_good_is_replaced(deployment, clear_prompt_set):
    """No restart left (ray.kill without restart: Ray reports ActorDiedError): the pool manager
    starts a new worker in its place, so the pool returns to its size."""
    expected = clear_prompt_set(32, MAX_TOKENS)
    wait_until(lambda: pools_whole(deployment), 180, "every worker up")
    pools = deployment.deployment.pools
    ray.kill(handle(deployment, "decode-1"), no_restart=True)
    wait_until(lambda: pools.replaced, 180, "a replacement for decode-1")
    [(gone, new)] = pools.replaced
    assert gone == "decode-1" and new.startswith("decode-") and new != "decode-1"
    wait_until(lambda: pools_whole(deployment), 60, "the pool whole again")
    workers = {w.worker_id for w in deployment.deployment.backend.workers()}
    assert "decode-1" not in workers and new in workers
    assert "decode-1" not in {w.worker_id for w in deployment.deployment.workers}
    serve_again(deployment, expected, new)


def test_scaling_up_and_down_under_load_loses_no_request(deployment, clear_prompt_set):
    expected = clear_prompt_set(32, MAX_TOKENS)
    backend = deployment.deployment.backend
    wait_until(lambda: pools_whole(deployment), 180, "every worker up")
    url = deployment.base_url
    steps = []

    async def scale_while_serving(load):
        async with httpx.AsyncClient(timeout=600) as admin:

            async def scale(**sizes):
                r = await admin.post(url + "/admin/scale", json=sizes)
                assert r.status_code == 200, r.text
                steps.append(r.json())

            await wait_async(lambda: len(load.results) >= 8 and max(load.chunks()) >= 1, 120, "the load to start")
            await scale(decode=3)  # a new decode worker, then
            # drain two decode workers and a prefill worker while they stream (drain timeout 2 s: they migrate)
            await wait_async(
                lambda: backend.pools.in_flight("decode-0") + backend.pools.in_flight("decode-1") > 0, 60, "busy"
            )
            await scale(decode=1, prefill=1)
            # at least as many requests as prompts, however fast this machine got through the steps
            await wait_async(lambda: len(load.results) >= len(expected), 120, "a request per prompt")
            load.stop.set()

    load = asyncio.run(_steady_load(url, expected, scale_while_serving))
    counts = check_results(load.results, [load.expected_of[k] for k in range(len(load.results))], DEADLINE_S)
    assert counts["exact"] == len(load.results) >= 32, counts  # every request, none lost
    assert backend.counters["migrations"] >= 1  # the drains moved streams that were still running

    grow, shrink = steps
    assert grow["after"] == {"prefill": 2, "decode": 3} and len(grow["added"]) == 1
    assert shrink["after"] == {"prefill": 1, "decode": 1} and len(shrink["removed"]) == 3
    pools = httpx.get(url + "/admin/pools", timeout=30).json()
    assert (pools["prefill"], pools["decode"]) == (1, 1) and len(pools["workers"]) == 2
    live = {w.worker_id for w in backend.workers()}
    for wid in shrink["removed"]:
        assert wid not in live and wid not in backend.prefix_index.workers()
    assert {w.worker_id for w in deployment.deployment.workers} == live
    assert_idle_and_leak_free(deployment)


@dataclasses.dataclass
class _SteadyLoad(Load):
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    expected_of: dict = dataclasses.field(default_factory=dict)  # request key -> its Expected


async def _steady_load(url, expected, during) -> _SteadyLoad:
    """Keep 8 streams in flight (cycling through the prompts) until `during` sets load.stop."""
    load = _SteadyLoad(url)
    keys = itertools.count()
    async with httpx.AsyncClient(timeout=DEADLINE_S + 30, limits=httpx.Limits(max_connections=16)) as client:

        async def worker(k: int):
            while not load.stop.is_set():
                key = next(keys)
                load.expected_of[key] = e = expected[key % len(expected)]
                await load.one(client, key, e.prompt, len(e.token_ids))

        tasks = [asyncio.create_task(worker(k)) for k in range(8)]
        await during(load)
        await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S + 30)
    return load
