"""RoundRobinPolicy: alternation within each pool, dead workers skipped, NoWorkerAvailable."""

from __future__ import annotations

import pytest

from router.backend import RouteDecision, WorkerInfo
from router.routing import NoWorkerAvailable, RoundRobinPolicy


def pool(prefill: int, decode: int, dead: set[str] = frozenset()) -> list[WorkerInfo]:
    workers = [WorkerInfo(f"p{i}", "prefill", alive=f"p{i}" not in dead) for i in range(prefill)]
    workers += [WorkerInfo(f"d{i}", "decode", alive=f"d{i}" not in dead) for i in range(decode)]
    return workers


def test_round_robin_alternates_each_pool_independently():
    policy = RoundRobinPolicy()
    workers = pool(2, 3)
    picks = [policy.choose([1, 2, 3], workers) for _ in range(6)]
    assert [p.prefill_worker for p in picks] == ["p0", "p1", "p0", "p1", "p0", "p1"]
    assert [p.decode_worker for p in picks] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert all(isinstance(p, RouteDecision) and p.reason == "round_robin" for p in picks)


def test_round_robin_skips_dead_workers_and_resumes():
    policy = RoundRobinPolicy()
    assert [policy.choose([1], pool(3, 1, dead={"p1"})).prefill_worker for _ in range(4)] == ["p0", "p2", "p0", "p2"]
    # p1 comes back: it joins the rotation after the last pick (p2 -> p0 -> p1 -> p2).
    assert [policy.choose([1], pool(3, 1)).prefill_worker for _ in range(3)] == ["p0", "p1", "p2"]


@pytest.mark.parametrize(
    "workers, missing",
    [
        (pool(0, 1), "prefill"),
        (pool(1, 0), "decode"),
        (pool(2, 2, dead={"p0", "p1"}), "prefill"),
        (pool(2, 2, dead={"d0", "d1"}), "decode"),
    ],
)
def test_no_worker_available(workers, missing):
    with pytest.raises(NoWorkerAvailable) as info:
        RoundRobinPolicy().choose([1], workers)
    assert info.value.pool == missing
    assert missing in str(info.value)


def test_local_prefill_fallback():
    decision = RoundRobinPolicy(local_prefill_fallback=True).choose([1], pool(0, 1))
    assert decision.prefill_worker is None and decision.decode_worker == "d0"
    with pytest.raises(NoWorkerAvailable):
        RoundRobinPolicy(local_prefill_fallback=True).choose([1], pool(1, 0))
