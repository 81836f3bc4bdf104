"""Prefill and decode pools of different tensor-parallel sizes over HTTP: the default model
(SmolLM2-135M: 3 KV heads) at prefill TP 3 -> decode TP 1 with an FP8 KV cache (three prefill
ranks' heads gathered into the one decode rank's cache through its inlets), and a tiny random
Llama with 4 KV heads at prefill TP 2 -> decode TP 4 (each prefill rank slices its two heads apart
through staging caches for two decode ranks).

Equal sizes are tests/e2e/test_tensor_parallel_serve.py's; prefill TP 1 -> decode TP 3 across
nodes over gloo is tests/cluster/test_tensor_parallel_nodes.py's.

Oracles: the engine alone at TP 1 in this process with the same FP8 KV cache, token for token up to
a near tie of its logits (the tiny model:
transformers' greedy generate); the links each pair of sizes needs, written out by hand; the KV
bytes a handoff must move, from the model's shape.
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from tests.engine.helpers import compare_greedy, hf_greedy, save_tiny_model, write_word_tokenizer

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16
# SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64 values per token.
ELEMENTS_PER_TOKEN = 30 * 2 * 3 * 64
# An FP8 value rounds to one of 8 steps per power of two: a top-2 gap below this may flip with summation order.
FP8_NEAR_TIE = 0.05


@pytest.fixture
def gathering_server(deployment_ray):
    """Prefill TP 3 -> decode TP 1, FP8 KV cache; stopped before the tiny model's test starts its own."""
    from cluster.config import BatonConfig
    from testkit.cluster import serving
    from testkit.harness import free_port

    # local_prefill_threshold=0: every request crosses the handoff between the two groups.
    config = BatonConfig.from_options(
        port=free_port(),
        kv_cache_memory="64MiB",
        kv_cache_dtype="fp8",
        prefill_tensor_parallel_size=3,
        decode_tensor_parallel_size=1,
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
    )
    with serving(config, actor_name_prefix="gather") as running:
        yield running


@pytest.fixture(scope="module")
def fp8_reference_engine():
    from workers.build import load_engine
    from workers.config import EngineConfig

    return load_engine(None, EngineConfig(kv_cache_memory=64 << 20, kv_cache_dtype="fp8"))


def test_three_prefill_ranks_feed_one_decode_rank_and_answers_equal_tp1(
    gathering_server, fp8_reference_engine, greedy_answers_match
):
    server = gathering_server
    before = server.stats()
    # Through the FP8 KV cache the haiku's second token is a near tie at TP 1 (top-2 gap 0.01-0.02
    # logits, against 0.13 with a float32 cache); the TP 3 prefill's other summation order may turn it.
    greedy_answers_match(server.base_url, fp8_reference_engine, near_tie=FP8_NEAR_TIE)

    after = server.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks for s in after.values()), "a block is still held"
    sent = after["prefill-0"].kv_blocks_sent - before["prefill-0"].kv_blocks_sent
    nbytes = after["prefill-0"].kv_bytes_sent - before["prefill-0"].kv_bytes_sent
    assert sent > 0 and sent == after["decode-0"].kv_blocks_received - before["decode-0"].kv_blocks_received
    # Every head of every block arrives once (one byte per FP8 value): had a link moved nothing,
    # a third would be missing.
    assert nbytes == sent * BLOCK_SIZE * ELEMENTS_PER_TOKEN
    assert server.deployment.backend.counters["local_prefill"] == 0
    # One link per KV head: prefill rank r -> decode rank 0.
    links = [(r, 0) for r in range(3)]
    recent = [t for t in httpx.get(server.base_url + "/v1/status").json()["recent"] if t["decision"] == "remote"]
    assert recent and all(t["kv_rank_pairs"] == [[s, d, t["kv_bytes"] // 3] for s, d in links] for t in recent)


def test_a_tiny_model_from_tp2_to_tp4_answers_as_transformers(deployment_ray):
    from cluster.config import BatonConfig
    from testkit.cluster import serving
    from testkit.harness import free_port

    # 8 query heads and 4 KV heads of 8: TP 2 holds two KV heads a rank, TP 4 one.
    folder, hf = save_tiny_model("llama", num_attention_heads=8, num_key_value_heads=4)
    write_word_tokenizer(folder)
    rng = random.Random(24)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 41))] for _ in range(4)]
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 8) for p in prompts]
    config = BatonConfig.from_options(
        model=folder,
        port=free_port(),
        kv_cache_memory="16MiB",
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
        prefill_tensor_parallel_size=2,
        decode_tensor_parallel_size=4,
    )
    with serving(config, actor_name_prefix="tp2to4") as server:
        for prompt, ref in zip(prompts, refs):
            r = httpx.post(
                server.base_url + "/v1/completions",
                timeout=120,
                json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1},
            )
            assert r.status_code == 200, r.text
            compare_greedy([int(t.removeprefix("t")) for t in r.json()["choices"][0]["logprobs"]["tokens"]], ref)
        recent = [t for t in httpx.get(server.base_url + "/v1/status").json()["recent"] if t["decision"] == "remote"]
        # Prefill rank 0 holds heads 0-1, rank 1 heads 2-3: each slices its two apart for two decode ranks.
        assert len(recent) == len(prompts) and all(
            t["kv_rank_pairs"] == [[s, d, t["kv_bytes"] // 4] for s, d in ((0, 0), (0, 1), (1, 2), (1, 3))]
            for t in recent
        )
