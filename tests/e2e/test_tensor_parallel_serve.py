"""The default model served at --tensor-parallel-size 3 (SmolLM2-135M: 9 query heads, 3 KV heads, one
per rank) over HTTP: both pools are groups of three Ray actors, rank 0 scheduling and broadcasting
each step, and every remote prefill moves each rank's KV head into the decode group's same rank.

Oracles: the engine alone at TP 1 in this process (itself checked against transformers in
tests/engine, where the sharded engine is also checked against TP 1 and transformers logit by
logit), and the KV bytes a handoff must move, computed by hand from the model's shape. A rank
killed mid-stream is tests/cluster/test_tensor_parallel_nodes.py's.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TP = 3
# SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64 float32 values per token.
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tp_server(deployment_ray):
    from cluster.config import BatonConfig
    from testkit.cluster import serving
    from testkit.harness import free_port

    # local_prefill_threshold=0: every request crosses the KV handoff between the two groups.
    config = BatonConfig.from_options(
        port=free_port(),
        kv_cache_memory="64MiB",
        tensor_parallel_size=TP,
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
        migration_wait=120.0,
    )
    with serving(config, actor_name_prefix="tp") as running:
        yield running


def test_greedy_answers_equal_tp1_and_every_rank_moves_its_heads(tp_server, reference_engine, greedy_answers_match):
    from testkit.cluster import tp_group_actors

    before = tp_server.stats()
    greedy_answers_match(tp_server.base_url, reference_engine)

    after = tp_server.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks for s in after.values()), "a block is still held"
    sent = {w: after[w].kv_blocks_sent - before[w].kv_blocks_sent for w in after}
    received = sum(after[w].kv_blocks_received - before[w].kv_blocks_received for w in after)
    nbytes = sum(after[w].kv_bytes_sent - before[w].kv_bytes_sent for w in after)
    assert sent["prefill-0"] > 0 and sent["prefill-0"] == received
    # Each block's bytes are the three ranks' heads together: had a rank moved nothing, a third is missing.
    assert nbytes == sent["prefill-0"] * BLOCK_SIZE * BYTES_PER_TOKEN
    assert tp_server.deployment.backend.counters["local_prefill"] == 0
    # The trace says what each rank pair moved: one KV head each, so a third of every handoff.
    status = httpx.get(tp_server.base_url + "/v1/status").json()
    recent = [t for t in status["recent"] if t["decision"] == "remote"]
    assert recent and all(
        t["kv_rank_pairs"] == [[i, i, t["kv_bytes"] // TP] for i in range(TP)] and t["kv_bytes"] > 0 for t in recent
    )
    for worker in ("tp-prefill-0", "tp-decode-0"):
        actors = tp_group_actors(worker)
        assert sorted(a.rank0 for a in actors) == [False] * (TP - 1) + [True], f"{worker}: {actors}"
        # The admin endpoint (and the dashboard from it) shows each worker's group: its size and the
        # processes of its ranks, as Ray's actor table has them.
        [shown] = [w for ws in status["pools"].values() for w in ws if f"tp-{w['worker_id']}" == worker]
        assert shown["tp_size"] == TP and shown["pid"] == next(a.pid for a in actors if a.rank0)
        assert sorted(shown["rank_pids"]) == sorted(a.pid for a in actors if not a.rank0)
