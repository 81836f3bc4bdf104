"""The simulator runs the real scheduler's priority policy: with a flood of low-priority requests
and a few urgent ones arriving later, the urgent ones' TTFT falls under the priority policy and
not under fcfs, and every request completes under both (the same requests each time)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from cluster.sim.costs import LinkModel, ServingOverheads
from cluster.sim.engine import EngineSettings
from cluster.sim.fitted_costs import FittedCostModel
from cluster.sim.simulator import ClusterSpec, simulate
from cluster.sim.workload import Client, SimRequest, Workload
from router.routing import RoutingConfig

# Every step 10 ms, plus 0.1 ms per token: prefill chunks cost more than decode steps.
COST = FittedCostModel(
    {"c0": 0.010, "c_token": 1e-4, "c_sampled": 0.0, "c_decode_ctx": 0.0, "c_prefill_pairs": 0.0, "c_decode_seq": 0.0},
    knee=1,
    kv_bytes_per_token=1000,
    kv_capacity_tokens=1 << 20,
)


def _workload() -> Workload:
    flood = [SimRequest(f"flood-{i}", tuple(range(3, 3 + 64)), 32, arrival_s=0.0, priority=10) for i in range(32)]
    urgent = [SimRequest(f"urgent-{i}", tuple(range(5, 5 + 64)), 32, arrival_s=0.5, priority=-10) for i in range(6)]
    return Workload((Client.open_loop("flood", flood), Client.open_loop("urgent", urgent)))


@pytest.mark.parametrize("prefill_workers", [0, 1])
def test_urgent_requests_overtake_a_flood_only_under_the_priority_policy(prefill_workers):
    ttft = {}
    for policy in ("fcfs", "priority"):
        engine = EngineSettings(max_num_seqs=4, scheduling_policy=policy)
        spec = ClusterSpec(prefill_workers, 1, engine, RoutingConfig(seed=0, local_prefill_threshold=0))
        result = simulate(
            _workload(), spec, COST, ServingOverheads(heartbeat_s=0.5), LinkModel("test", bandwidth_bytes_s=1e9)
        )
        assert all(r.completed for r in result.records)
        ttft[policy] = statistics.median(r.ttft_s for r in result.records if r.request_id.startswith("urgent"))
    assert ttft["priority"] < 0.5 * ttft["fcfs"], ttft
    with pytest.raises(ValueError, match="scheduling policy"):
        dataclasses.replace(EngineSettings(), scheduling_policy="lifo")


def test_a_small_tenant_overtakes_a_flooding_one_only_under_the_priority_policy():
    flood = [SimRequest(f"big-{i}", tuple(range(3, 67)), 32, arrival_s=0.0, tenant="big") for i in range(32)]
    small = [SimRequest(f"small-{i}", tuple(range(5, 69)), 32, arrival_s=0.5, tenant="small") for i in range(6)]
    workload = Workload((Client.open_loop("big", flood), Client.open_loop("small", small)))
    ttft = {}
    for policy in ("fcfs", "priority"):
        spec = ClusterSpec(0, 1, EngineSettings(max_num_seqs=4, scheduling_policy=policy), RoutingConfig(seed=0))
        result = simulate(
            workload, spec, COST, ServingOverheads(heartbeat_s=0.5), LinkModel("t", bandwidth_bytes_s=1e9)
        )
        assert all(r.completed for r in result.records)
        ttft[policy] = statistics.median(r.ttft_s for r in result.records if r.request_id.startswith("small"))
    assert ttft["priority"] < 0.5 * ttft["fcfs"], ttft
