"""Prefill and decode pools of different tensor-parallel sizes over HTTP, on the default model
(SmolLM2-135M: 3 KV heads): prefill TP 3 -> decode TP 1 (three prefill ranks' heads gathered into
the one decode rank's cache through its inlets) and prefill TP 1 -> decode TP 3 with an FP8 KV
cache (the prefill rank slices its heads apart through staging caches); and a tiny random Llama
with 4 KV heads at prefill TP 2 -> decode TP 4.

Oracles: the engine alone at TP 1 in this process, in the same KV dtype (the tiny model:
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


# One server per case, stopped before the next module-level server starts (a module-scoped one would
# still be up, and its Ray connection left, when the tiny model's test starts its own).
@pytest.fixture(params=[(3, 1, "auto"), (1, 3, "fp8")], ids=["tp3-to-tp1", "tp1-to-tp3-fp8"])
def mixed_server(request):
    from cluster.config import BatonConfig
    from cluster.harness import free_port
    from cluster.testing import leave_ray, serving

    prefill_tp, decode_tp, kv_dtype = request.param
    # local_prefill_threshold=0: every request crosses the handoff between the two groups.
    config = BatonConfig.from_options(port=free_port(), kv_cache_memory="64MiB", kv_cache_dtype=kv_dtype,
                                      prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
                                      local_prefill_threshold=0, prefill_queue_threshold=10**6)
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


def test_a_tiny_model_from_tp2_to_tp4_answers_as_transformers():
    from cluster.config import BatonConfig
    from cluster.harness import free_port
    from cluster.testing import leave_ray, serving

    # 8 query heads and 4 KV heads of 8: TP 2 holds two KV heads a rank, TP 4 one.
    folder, hf = save_tiny_model("llama", num_attention_heads=8, num_key_value_heads=4)
    write_word_tokenizer(folder)
    rng = random.Random(24)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 41))] for _ in range(4)]
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 8) for p in prompts]
    config = BatonConfig.from_options(model=folder, port=free_port(), kv_cache_memory="16MiB", local_prefill_threshold=0,
                                      prefill_queue_threshold=10**6, prefill_tensor_parallel_size=2,
                                      decode_tensor_parallel_size=4)
    leave_ray()
    with serving(config, actor_name_prefix="tp2to4") as server:
        for prompt, ref in zip(prompts, refs):
            r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                           json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            compare_greedy([int(t.removeprefix("t")) for t in r.json()["choices"][0]["logprobs"]["tokens"]], ref)
        recent = [t for t in httpx.get(server.base_url + "/v1/status").json()["recent"] if t["decision"] == "remote"]
        # Prefill rank 0 holds heads 0-1, rank 1 heads 2-3: each slices its two apart for two decode ranks.
        assert len(recent) == len(prompts) and all(
            t["kv_rank_pairs"] == [[s, d, t["kv_bytes"] // 4] for s, d in ((0, 0), (0, 1), (1, 2), (1, 3))]
            for t in recent)
