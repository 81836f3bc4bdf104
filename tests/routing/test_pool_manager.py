"""cluster.pool_manager.PoolManager over fake actors (no Ray): scaling starts workers before it
drains others, a drained worker's streams finish exactly elsewhere, a worker dead for good is
replaced (and a failed replacement is retried later, the dead worker kept listed until then).

Ray's part (spawning, placing, the KV handshake) is replaced by stand-ins that record what they
were asked; the oracle for the streams is the fake workers' script (tests/routing/fake_actors.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import cluster.pool_manager as pm
from cluster.config import BatonConfig
from cluster.launcher import Deployment
from cluster.placement import SpawnedWorker
from common.roles import Role
from router.pools import WorkerPools
from router.ray_backend import RayBackend

from .fake_actors import FakeActor
from .test_migration import STEP_S, assert_exact, prompt_of, stream, wait_for


@pytest.fixture
def fake_ray(monkeypatch):
    """Spawning makes FakeActors; `fail` makes the next spawns raise (a worker that cannot start)."""
    state = {"spawned": [], "fail": 0}

    def spawn_worker(config, role, index, prefix, placement, **options):
        if state["fail"]:
            state["fail"] -= 1
            raise RuntimeError("no node can start it")
        wid = f"{role}-{index}"
        state["spawned"].append((wid, options))
        return SpawnedWorker(wid, Role(role), index, FakeActor(wid, role, step_s=STEP_S), None, f"{prefix}-{wid}")

    monkeypatch.setattr(pm, "spawn_worker", spawn_worker)
    monkeypatch.setattr(pm, "wait_placed", lambda workers, timeout_s: {w.worker_id: "node" for w in workers})
    monkeypatch.setattr(pm, "connect_pairs", lambda prefill, decode, timeout_s=60.0: {})
    monkeypatch.setattr(pm, "HEAL_RETRY_S", 0.2)
    # ray.kill would start a local Ray to kill a fake: record instead.
    state["killed"] = []
    monkeypatch.setattr(pm, "_kill", lambda handle: state["killed"].append(handle.worker_id))
    return state


def make_deployment(**options):
    config = BatonConfig.from_options(prefill_workers=1, decode_workers=1, drain_timeout=0.1, max_restarts=2, **options)
    actors = [FakeActor("prefill-0", "prefill"), FakeActor("decode-0", "decode", step_s=STEP_S)]
    workers = [SpawnedWorker(a.worker_id, Role(a.role), 0, a, None, a.worker_id) for a in actors]
    backend = RayBackend(WorkerPools(workers, health_interval_s=0.05, health_timeout_s=0.5, poll_timeout_s=0.02))
    deployment = Deployment(config, Path("."), "m", 4096, 16, workers, backend, False)
    deployment.pools = pm.PoolManager(deployment, "test")
    backend.pools.actor_state = lambda handle: handle.ray_state  # what Ray would say of a real actor
    return deployment, {a.worker_id: a for a in actors}


def test_scale_up_then_down_moves_running_streams_and_stops_the_removed_worker(fake_ray):
    async def main():
        deployment, actors = make_deployment()
        backend, pools = deployment.backend, deployment.pools
        resized = []
        pools.subscribe_resize(resized.append)
        try:
            backend.workers()
            up = await pools.scale(decode=2)
            assert up.added == ["decode-1"] and up.after == {"prefill": 1, "decode": 2}
            assert fake_ray["spawned"] == [("decode-1", {"max_restarts": 2})]
            new = next(w.handle for w in deployment.workers if w.worker_id == "decode-1")
            assert [w.worker_id for w in deployment.workers] == ["prefill-0", "decode-0", "decode-1"]
            # Long streams on decode-0, then scale down: decode-0 is the busiest, decode-1 goes.
            tasks = [asyncio.create_task(stream(backend, f"r{i}", prompt_of(i), 60, "decode-1")) for i in range(2)]
            tasks += [asyncio.create_task(stream(backend, f"s{i}", prompt_of(i + 5), 60, "decode-0")) for i in range(3)]
            await wait_for(lambda: len(new.running) == 2 and len(actors["decode-0"].running) == 3)
            down = await pools.scale(decode=1)
            assert down.removed == ["decode-1"] and down.moved_requests == 2 and down.after["decode"] == 1
            assert new.stopped and fake_ray["killed"] == ["decode-1"]
            assert "decode-1" not in {w.worker_id for w in deployment.workers}
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            for i, result in enumerate(results):
                assert_exact(result, prompt_of(i if i < 2 else i + 3), 60)
            assert [(t.prefill, t.decode) for t in resized] == [(1, 2), (1, 1)]
            assert pools.pools().decode == 1 and len(pools.pools().workers) == 2
            with pytest.raises(ValueError, match="at least 1"):
                await pools.scale(decode=0)
            assert pools.targets.decode == 1
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_worker_the_memory_monitor_killed_for_good_is_replaced(fake_ray):
    """Ray (2.60) answers every call to an actor its memory monitor killed with OutOfMemoryError,
    restarts left or not: only Ray's state of the actor says it is DEAD. Without asking it, such a
    worker stays down for ever and the deployment answers 503 until it is restarted."""

    async def main():
        deployment, actors = make_deployment()
        backend, pools = deployment.backend, deployment.pools
        try:
            backend.workers()
            actors["decode-0"].kill(oom=True)
            await wait_for(lambda: pools.replaced, timeout_s=5)
            assert pools.replaced == [("decode-0", "decode-1")]
            assert [w.worker_id for w in backend.workers()] == ["prefill-0", "decode-1"]
            assert_exact(await stream(backend, "after", prompt_of(3), 5, "decode-1"), prompt_of(3), 5)
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_worker_restarting_after_the_memory_monitor_killed_it_is_not_replaced(fake_ray):
    async def main():
        deployment, actors = make_deployment()
        backend, pools = deployment.backend, deployment.pools
        try:
            backend.workers()
            actors["decode-0"].kill(restart_after_s=0.5, oom=True)  # RESTARTING, then back
            await wait_for(lambda: not backend.pools.get("decode-0").alive)
            await wait_for(lambda: backend.pools.get("decode-0").alive, timeout_s=5)
            assert pools.replaced == [] and backend.pools.gone_workers() == []
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_worker_dead_for_good_is_replaced_and_a_failed_replacement_retried(fake_ray):
    async def main():
        deployment, actors = make_deployment()
        backend, pools = deployment.backend, deployment.pools
        try:
            backend.workers()
            fake_ray["fail"] = 1
            actors["decode-0"].kill()  # ActorDiedError: no restart left
            await wait_for(lambda: backend.pools.gone_workers() == ["decode-0"])
            await wait_for(lambda: pools.replaced, timeout_s=5)
            # After one failed try (which used the id decode-1), HEAL_RETRY_S later.
            assert pools.replaced == [("decode-0", "decode-2")]
            assert [w.worker_id for w in backend.workers()] == ["prefill-0", "decode-2"]
            assert [w.worker_id for w in deployment.workers] == ["prefill-0", "decode-2"]
            assert fake_ray["killed"] == ["decode-0"] and actors["decode-0"].calls[-1] == "shutdown"
            assert_exact(await stream(backend, "after", prompt_of(3), 5, "decode-2"), prompt_of(3), 5)
        finally:
            await backend.close()

    asyncio.run(main())
