"""Helpers for cluster mode tests (tests/cluster), importable by any module there:

    from cluster_fixtures import POOL_NODES, actor_nodes, cluster_config, serving_on

- `cluster_config(fake_cluster, **options)`: a BatonConfig that joins the fake cluster, 2 prefill
  and 2 decode workers with one thread (one Ray CPU) each, so each worker takes one simulated
  node; options are flat option names, as `BatonConfig.from_options` takes them.
- `serving_on(config, prefix)`: deploy and run the router on 127.0.0.1 for a `with` block; yields
  a `RunningServer` (`.base_url`, `.deployment`, `.stats()`, `.wait_idle()`).
- `actor_nodes(deployment)`: worker id -> Ray node id, read from Ray's own actor table.
"""

from __future__ import annotations

import ray

from cluster.config import BatonConfig
from testkit.cluster import FakeCluster, NodeType, free_port, serving

POOL_NODES = [
    NodeType("prefill", 2, {"CPU": 1, "baton_prefill": 1}, {"baton-pool": "prefill"}),
    NodeType("decode", 2, {"CPU": 1, "baton_decode": 1}, {"baton-pool": "decode"}),
]


def cluster_config(cluster: FakeCluster, **options) -> BatonConfig:
    defaults = dict(
        address=cluster.address,
        prefill_workers=2,
        decode_workers=2,
        threads_per_worker=1,
        kv_cache_memory="64MiB",
        max_num_seqs=16,
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
        port=free_port(),
        placement_timeout=60.0,
    )
    return BatonConfig.from_options(**{**defaults, **options})


def serving_on(config: BatonConfig, prefix: str = "baton"):
    """Deploy `config` and serve it on 127.0.0.1:config.server.port for the block (tests/e2e's `serving`)."""
    return serving(config, actor_name_prefix=prefix)


def actor_nodes(deployment) -> dict[str, str]:
    """Worker id -> the node id Ray's actor table gives for its actor (independent of Baton)."""
    out = {}
    for w in deployment.workers:
        info = ray._private.state.actors(w.handle._actor_id.hex())
        out[w.worker_id] = info["Address"]["NodeID"]
    return out
