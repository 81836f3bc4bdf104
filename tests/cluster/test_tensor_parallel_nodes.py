"""Tensor-parallel workers on a Ray cluster of simulated nodes (testkit.cluster.FakeCluster, all on
127.0.0.1): a head, one prefill node and two decode nodes of 3 CPUs each; the default model served
by a prefill worker at TP 1 and a decode worker at TP 3 (one rank per CPU), so every handoff
re-slices the KV heads across nodes, over gloo.

Oracles: where each rank runs comes from Ray's own actor table; greedy float32 answers must equal
the engine alone in this process (tests/healing/helpers.py). A rank's process is SIGKILLed while
8 streams run: its group must restart (the streams' only decode worker) and the streams end
exactly as the engine alone answers them.
"""

from __future__ import annotations

import asyncio

import pytest
from cluster_fixtures import cluster_config, serving_on

from testkit.cluster import FakeCluster, NodeType, leave_ray, tp_group_actors
from tests.healing.helpers import check_results, kill_when_running, run_load

pytestmark = pytest.mark.slow
DEADLINE_S = 240.0
NODES = [
    NodeType("prefill", 1, {"CPU": 1, "baton_prefill": 1}, {"baton-pool": "prefill"}),
    NodeType("decode", 2, {"CPU": 3, "baton_decode": 1}, {"baton-pool": "decode"}),
]


@pytest.fixture(scope="module")
def tp_cluster():
    leave_ray()  # whatever Ray an earlier suite left connected: this module needs its own cluster
    with FakeCluster(NODES, head_cpus=1) as cluster:
        yield cluster


def group_nodes(worker_actor_name: str) -> tuple[list[int], dict[int, str]]:
    """A worker's live rank 0 pids, and pid -> node id of each of its live ranks (rank 0 included)."""
    actors = tp_group_actors(worker_actor_name)
    return [a.pid for a in actors if a.rank0], {a.pid: a.node_id for a in actors}


def test_a_group_lands_on_one_node_and_a_killed_rank_restarts_it(tp_cluster, clear_prompt_set):
    expected = clear_prompt_set(8, 24)
    config = cluster_config(
        tp_cluster,
        prefill_workers=1,
        decode_workers=1,
        decode_tensor_parallel_size=3,
        max_num_seqs=16,
        request_timeout=DEADLINE_S,
        max_restarts=2,
        migration_wait=120.0,
    )
    with serving_on(config, "tpnodes") as server:
        deployment = server.deployment
        name = "tpnodes-decode-0"
        rank0, where = group_nodes(name)
        assert len(where) == 3 and len(set(where.values())) == 1, where  # three ranks, one node
        assert set(where.values()) <= tp_cluster.node_ids("decode")
        assert deployment.kv_links == {("prefill-0", "decode-0"): "gloo"}  # another node: gloo

        decode = next(w.handle for w in deployment.workers if w.worker_id == "decode-0")
        victim = next(pid for pid in where if pid not in rank0)

        async def kill_a_rank(load):
            await kill_when_running(decode, [victim])

        load = asyncio.run(run_load(server.base_url, expected, kill_a_rank, DEADLINE_S + 30))
        counts = check_results(load.results, expected, DEADLINE_S)
        assert counts["exact"] == len(expected), counts
        # The only decode worker's group had to come back for the migrated streams to end: it restarted.
        assert deployment.backend.counters["migrations"] >= 1, deployment.backend.counters
