"""Every model family over HTTP: a tiny random model of each, built from its family's transformers
config (shrunk; sliding windows of 16 tokens where the family has them, against prompts of 20 to
40), served by a real deployment (a prefill and a decode worker on Ray, the router over HTTP, every
request through the KV handoff, chunked prefill at 16 tokens a step). Oracle: transformers'
greedy `generate` on the same weights, token by token, and the logprob of each token the server
returns against transformers' log-softmax at that step (within 1e-3 before any near tie).
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from tests.engine.helpers import compare_greedy, hf_greedy, save_tiny_model, write_word_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
WINDOW = 16
GEMMA = dict(num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW)
FAMILIES = {
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=32)),
    "phi3": ("phi3", dict(tie_word_embeddings=False, sliding_window=WINDOW)),  # every layer windowed
    "gemma2": (
        "gemma2",
        dict(
            GEMMA,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=2.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    "gemma3": (
        "gemma3",
        dict(GEMMA, num_key_value_heads=1, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    ),
    "mixtral": ("mixtral", dict(tie_word_embeddings=False)),
    "qwen3_moe": ("qwen3_moe", dict(tie_word_embeddings=False, norm_topk_prob=True, mlp_only_layers=[1])),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_served_tiny_model_answers_as_transformers(family, deployment_ray):
    from cluster.config import BatonConfig
    from testkit.cluster import serving
    from testkit.harness import free_port

    kind, overrides = FAMILIES[family]
    folder, hf = save_tiny_model(kind, **overrides)
    write_word_tokenizer(folder)
    rng = random.Random(len(family))
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 41))] for _ in range(10)]
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    config = BatonConfig.from_options(
        model=folder,
        port=free_port(),
        kv_cache_memory="16MiB",
        max_num_batched_tokens=16,
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
    )
    with serving(config, actor_name_prefix=f"families-{family}") as server:
        for prompt, ref in zip(prompts, refs):
            r = httpx.post(
                server.base_url + "/v1/completions",
                timeout=120,
                json={"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 1},
            )
            assert r.status_code == 200, r.text
            logprobs = r.json()["choices"][0]["logprobs"]
            ours = [int(t.removeprefix("t")) for t in logprobs["tokens"]]
            checked = compare_greedy(ours, ref).diverged_at or len(ours)
            for step in range(checked):
                want = float(torch.log_softmax(ref.logits[step], -1)[ours[step]])
                assert abs(logprobs["token_logprobs"][step] - want) < 1e-3, f"{family}: step {step} logprob"
        assert server.deployment.backend.counters["remote_prefill"] == len(prompts)
