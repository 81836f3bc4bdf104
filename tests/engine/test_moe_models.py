"""Tiny random Mixtral and Qwen3-MoE models: the engine's float32 greedy tokens and logits match transformers.

Chunked prefill (max_num_batched_tokens 32, so prompts span several steps) and prefix caching
(a second batch reuses the first's cached prefix) are on. Also: both checkpoint layouts (per-expert
tensors, fused 3-D), Qwen3-MoE's dense layers, and the refusals (a float checkpoint labelled FP8,
shared experts, unknown families).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.sampling_params import SamplingParams
from tests.engine.helpers import compare_greedy, hf_greedy, run_with_logits, save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.engine.loader import load_model
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.models.moe import MoeForCausalLM, SparseMoeBlock

CASES = {
    "mixtral-8x-top2-untied": ("mixtral", dict(tie_word_embeddings=False)),
    "mixtral-4x-top2-tied-gqa4": (
        "mixtral",
        dict(num_local_experts=4, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3moe-8x-top2": ("qwen3_moe", dict(tie_word_embeddings=False, head_dim=32)),
    # norm_topk_prob, and dense MLP layers: layer 0 (mlp_only_layers) and every odd one (decoder_sparse_step 2).
    "qwen3moe-normtopk-dense-layers": (
        "qwen3_moe",
        dict(
            tie_word_embeddings=False,
            norm_topk_prob=True,
            num_hidden_layers=4,
            decoder_sparse_step=2,
            mlp_only_layers=[1],
        ),
    ),
}
NEW_TOKENS = 16


def _refs(hf, prompts):
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [hf_greedy(hf, p, NEW_TOKENS, eos_token_id=None) for p in prompts]


def _check(engine, hf, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    completions, logits = run_with_logits(engine, prompts, params)
    diverged = [
        i
        for i, (c, r, lg) in enumerate(zip(completions, _refs(hf, prompts), logits))
        if compare_greedy(c.token_ids, r, lg).diverged_at is not None
    ]
    assert len(diverged) <= 1, diverged  # a near tie may flip one sequence (compare_greedy checks it is one)
    return completions


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_moe_matches_transformers(case):
    kind, overrides = CASES[case]
    folder, hf = save_tiny_model(kind, **overrides)
    config = ModelConfig.from_model_dir(folder)
    assert config.num_experts == (hf.config.num_local_experts if kind == "mixtral" else hf.config.num_experts)
    assert config.num_experts_per_tok == 2
    engine = build_engine(config, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=32), iter_safetensors(folder))
    model = engine.runner.model
    rng = random.Random(11)
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    first = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 15, 17, 70)] + [prefix + [7, 8, 9]]
    _check(engine, hf, first)
    # The second batch shares the first's 40-token prefix: its blocks come from the prefix cache.
    second = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 30)]
    done = _check(engine, hf, second)
    assert all(c.num_cached_tokens >= 32 for c in done), [c.num_cached_tokens for c in done]
    assert isinstance(model, MoeForCausalLM)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [
        i not in config.dense_mlp_layers for i in range(config.num_layers)
    ]


def test_dense_layers_of_qwen3_moe_come_from_the_config():
    _, overrides = CASES["qwen3moe-normtopk-dense-layers"]
    folder, _ = save_tiny_model("qwen3_moe", **overrides)
    config = ModelConfig.from_model_dir(folder)
    # decoder_sparse_step 2: layers 1 and 3 sparse; mlp_only_layers [1] makes 1 dense too.
    assert config.dense_mlp_layers == (0, 1, 2) and config.norm_topk_prob and config.qk_norm
    assert config.moe_intermediate_size == 48 and config.intermediate_size == 160


def test_fused_3d_expert_checkpoint_loads(tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    folder, hf = save_tiny_model("mixtral", tie_word_embeddings=False)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(folder) / "config.json").read_text())
    engine = build_engine(
        ModelConfig.from_model_dir(tmp_path), EngineConfig(num_kv_blocks=32), iter_safetensors(tmp_path)
    )
    _check(engine, hf, [[5, 6, 7, 8, 9, 10]])


class _Fp8Checkpoint(list):
    """A float checkpoint that says it is pre-quantized FP8 (config.json's quantization_config)."""

    quantization_config = {"quant_method": "fp8"}


def test_missing_expert_and_mislabelled_fp8_checkpoints_are_refused(tmp_path):
    folder, hf = save_tiny_model("qwen3_moe", tie_word_embeddings=False)
    config = ModelConfig.from_model_dir(folder)
    weights = [(n, t) for n, t in iter_safetensors(folder) if "experts.3.up_proj" not in n]
    with pytest.raises(ValueError, match="missing .* router/expert tensors"):
        load_model(config, EngineConfig(num_kv_blocks=8), weights)
    with pytest.raises(ValueError, match="a torch.float32 expert weight in an FP8 checkpoint"):
        load_model(config, EngineConfig(num_kv_blocks=8), _Fp8Checkpoint(iter_safetensors(folder)))


def test_moe_config_refusals():
    base = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    assert ModelConfig.from_dict(base).num_experts == 4
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="shared experts"):
        ModelConfig.from_dict({**base, "shared_expert_intermediate_size": 64})
    dense = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    assert dense.num_experts == 0 and dense.dense_mlp_layers == ()


def test_serve_refuses_an_unsupported_family_listing_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    for family in (
        "DeepseekV3ForCausalLM",
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    ):
        assert family in proc.stderr, proc.stderr[-2000:]


def test_bfloat16_moe_stays_close_to_float32_transformers():
    folder, hf = save_tiny_model("mixtral", tie_word_embeddings=False)
    engine = build_engine(
        ModelConfig.from_model_dir(folder), EngineConfig(num_kv_blocks=64, dtype="bfloat16"), iter_safetensors(folder)
    )
    prompts = [[random.Random(i).randrange(3, 512) for _ in range(30)] for i in range(3)]
    _, logits = run_with_logits(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    for ref, ours in zip(_refs(hf, prompts), logits):
        # bfloat16 keeps 8 bits of mantissa: logits of magnitude ~0.5 within a few 1e-3.
        assert float((ours[0] - ref.logits[0]).abs().max()) < 3e-2
        assert int(ours[0].argmax()) == ref.token_ids[0]
