"""Fixtures of cluster mode tests; the helpers they use are in cluster_fixtures.py.

- `fake_cluster` (module scope): Ray's fake multi-node provider (`testkit.cluster.FakeCluster`)
  with a head (1 CPU, no Baton resource: where the driver and router run) and the two pool node
  types of a `ray up` cluster, all on 127.0.0.1:
      prefill: 2 nodes, each {CPU: 1, baton_prefill: 1}, labels {baton-pool: prefill}
      decode:  2 nodes, each {CPU: 1, baton_decode: 1},  labels {baton-pool: decode}
  This test process is the Ray driver on it while the module runs: a driver connection an
  earlier suite left in this process is ended first (`testkit.cluster.leave_ray`), and the
  cluster's processes are stopped by process group after the module.
  `fake_cluster.node_ids("decode")` gives the Ray node ids of a node type;
  `fake_cluster.kill_node(node_id)` SIGKILLs one simulated node's processes (raylet and
  workers), as when a machine dies. The simulated nodes run with `HF_HUB_CACHE` set to an empty
  folder (`fake_cluster.node_hf_cache`), which the "model files on every node" test relies on.
- `reference_engine`: the engine alone in this process, the oracle for greedy answers, and
  `clear_prompt_set(n, max_tokens)`: prompts whose greedy answers it decides clearly; both are
  the session's one `tests.healing.helpers.session_oracle`, which tests/healing shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_fixtures import POOL_NODES

from testkit.cluster import FakeCluster, leave_ray
from tests.healing.helpers import session_oracle


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    leave_ray()  # whatever Ray an earlier suite left connected: this module needs its own cluster
    empty_hf_cache = tmp_path_factory.mktemp("node-hf-cache")
    cluster = FakeCluster(POOL_NODES, head_cpus=1, env={"HF_HUB_CACHE": str(empty_hf_cache), "HF_HUB_OFFLINE": "1"})
    cluster.node_hf_cache = Path(empty_hf_cache)
    with cluster:
        yield cluster


@pytest.fixture(scope="session")
def reference_engine(request):
    return session_oracle(request.config).engine


@pytest.fixture(scope="session")
def clear_prompt_set(request, reference_engine, tokenizer):
    """A function (n, max_tokens) -> n prompts with clear greedy answers (tests/healing/helpers.py), cached."""
    oracle = session_oracle(request.config)
    return lambda n, max_tokens: oracle.clear_prompts(tokenizer, n, max_tokens)
