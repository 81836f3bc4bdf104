"""Prefill and decode pools of different tensor-parallel sizes over HTTP, on the default model
(SmolLM2-135M: 3 KV heads): prefill TP 3 -> decode TP 1 (three prefill ranks' heads gathered into
the one decode rank's cache through its inlets) and prefill TP 1 -> decode TP 3 with an FP8 KV
cache (the prefill rank slices its heads apart through staging caches).

Oracles: the engine alone at TP 1 in this process, in the same KV dtype; the links each pair of
sizes needs, written out by hand; the KV bytes a handoff must move, from the model's shape.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16
# SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64 values per token.
ELEMENTS_PER_TOKEN = 30 * 2 * 3 * 64


@pytest.fixture(scope="module", params=[(3, 1, "auto"), (1, 3, "fp8")], ids=["tp3-to-tp1", "tp1-to-tp3-fp8"])
def mixed_server(request):
    from cluster.config import BatonConfig
    from cluster.harness import free_port
    from cluster.testing import leave_ray, serving

    prefill_tp, decode_tp, kv_dtype = request.param
    # local_prefill_threshold=0: every request crosses the handoff between the two groups.
    config = BatonConfig.from_options(port=free_port(), kv_cache_memory="64MiB", kv_cache_dtype=kv_dtype,
                                      prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
                                      local_prefill_threshold=0)
    leave_ray()
    with serving(config) as running:
        yield running, request.param


@pytest.fixture(scope="module")
def fp8_reference_engine():
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    return LLMEngine.from_model_dir(None, EngineConfig(kv_cache_memory=64 << 20, kv_cache_dtype="fp8"))


def test_greedy_answers_equal_tp1_and_each_link_moves_its_heads(mixed_server, reference_engine, fp8_reference_engine,
                                                                 greedy_answers_match):
    server, (prefill_tp, decode_tp, kv_dtype) = mixed_server
    engine = fp8_reference_engine if kv_dtype == "fp8" else reference_engine
    before = server.stats()
    greedy_answers_match(server.base_url, engine)

    after = server.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks for s in after.values()), "a block is still held"
    sent = after["prefill-0"].kv_blocks_sent - before["prefill-0"].kv_blocks_sent
    nbytes = after["prefill-0"].kv_bytes_sent - before["prefill-0"].kv_bytes_sent
    assert sent > 0 and sent == after["decode-0"].kv_blocks_received - before["decode-0"].kv_blocks_received
    # Every head of every block arrives once: had a link moved nothing, a third would be missing.
    assert nbytes == sent * BLOCK_SIZE * ELEMENTS_PER_TOKEN * (1 if kv_dtype == "fp8" else 4)
    assert server.deployment.backend.counters["local_prefill"] == 0
    # One link per KV head: prefill rank r -> decode rank 0 (TP 3 -> 1), or prefill rank 0 -> decode rank r.
    links = [(r, 0) for r in range(3)] if prefill_tp == 3 else [(0, r) for r in range(3)]
    recent = [t for t in httpx.get(server.base_url + "/v1/status").json()["recent"] if t["decision"] == "remote"]
    assert recent and all(t["kv_rank_pairs"] == [[s, d, t["kv_bytes"] // 3] for s, d in links] for t in recent)
