"""A whole simulated node dies during 32 streaming requests: a head, a prefill node and three
decode nodes on 127.0.0.1 (testkit.cluster.FakeCluster, a fresh one: the test kills one of its
nodes), 1 prefill and 2 decode workers, one per node, so one decode node is spare.

The test SIGKILLs every process of one decode node (its raylet and the decode worker on it, as
`FakeCluster.kill_node` finds them), as when a machine goes away. The requests streaming from that
worker migrate to the other decode
worker and must end exactly as the engine alone answers them (greedy float32,
tests/healing/helpers.py), or with a clean error, all within their deadline; the survivors leak
no block; and the pool returns to its size: Ray restarts the worker (a restartable actor) on the
spare node, the router re-admits it, and it serves again. Where each worker runs comes from Ray's
own actor table.

Why a spare node rather than the autoscaler replacing the dead one: Ray's fake multi-node
provider keeps a killed node in its list as "pending" for ever (it never loses a heartbeat it
never had), so it neither terminates nor replaces it; a real provider does.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from cluster_fixtures import POOL_NODES, actor_nodes, cluster_config, serving_on

from testkit.cluster import FakeCluster, NodeType, leave_ray
from tests.healing.helpers import check_results, kill_when_running, run_load, wait_async

pytestmark = pytest.mark.slow
DEADLINE_S = 240.0


@pytest.fixture(scope="module")
def spare_cluster():
    leave_ray()  # whatever Ray an earlier suite left connected: this module needs its own cluster
    prefill, decode = POOL_NODES
    # One prefill node: what is tested is the decode pool, and each simulated node is a raylet and
    # a worker process more for the two cores to start.
    with FakeCluster(
        [
            NodeType(prefill.name, 1, prefill.resources, prefill.labels),
            NodeType(decode.name, decode.count + 1, decode.resources, decode.labels),
        ]
    ) as cluster:
        yield cluster


def _alive_pools(deployment, size: int) -> bool:
    infos = deployment.backend.workers()
    return len(infos) == size and all(w.alive for w in infos)


async def _nothing(load) -> None:
    return None


def test_a_decode_node_dies_mid_stream_and_the_pool_heals(spare_cluster, clear_prompt_set):
    expected = clear_prompt_set(32, 16)
    config = cluster_config(
        spare_cluster,
        prefill_workers=1,
        max_num_seqs=32,
        routing_policy="round-robin",
        request_timeout=DEADLINE_S,
        max_restarts=2,
    )
    with serving_on(config, "nodekill") as server:
        deployment = server.deployment
        backend = deployment.backend
        where = actor_nodes(deployment)
        victim_node = where["decode-0"]
        assert victim_node in spare_cluster.node_ids("decode")

        # The node's processes (raylet, decode-0's worker), found now: at the moment of the kill
        # there is no time to scan /proc, the streams would finish first.
        node_pids = spare_cluster.node_pids(victim_node)
        assert len(node_pids) >= 2, node_pids

        victim = next(w.handle for w in deployment.workers if w.worker_id == "decode-0")

        async def kill_node_mid_stream(load):
            await kill_when_running(victim, node_pids)

        load = asyncio.run(run_load(server.base_url, expected, kill_node_mid_stream, DEADLINE_S + 30))
        counts = check_results(load.results, expected, DEADLINE_S)
        assert counts["exact"] == 32 and backend.counters["migrations"] >= 1, (counts, backend.counters)

        # Ray restarts decode-0 on the spare decode node and the router re-admits it.
        asyncio.run(
            wait_async(lambda: _alive_pools(deployment, 3), 300, "decode-0 back on the spare node", every_s=0.5)
        )
        moved_to = actor_nodes(deployment)["decode-0"]
        assert moved_to != victim_node and moved_to in spare_cluster.node_ids("decode")
        assert moved_to != actor_nodes(deployment)["decode-1"]

        stats = server.wait_idle(timeout_s=60)
        for wid, s in stats.items():
            assert s.num_running == 0 and s.num_free_blocks == s.num_blocks, (wid, s)
        before = ray.get(next(w.client for w in deployment.workers if w.worker_id == "decode-0").stats(), timeout=60)
        again = asyncio.run(run_load(server.base_url, expected[:8], _nothing, DEADLINE_S))
        assert check_results(again.results, expected[:8], DEADLINE_S)["exact"] == 8
        after = ray.get(next(w.client for w in deployment.workers if w.worker_id == "decode-0").stats(), timeout=60)
        assert after.generation_tokens > before.generation_tokens  # round-robin: half went to the new decode-0
