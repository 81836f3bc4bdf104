"""Tiny random Llama, Mistral, Qwen2 and Qwen3 models: greedy tokens and logits match transformers.

Covers GQA ratios, tied and untied embeddings, Qwen2's q/k/v biases, Qwen3's per-head q/k norms, an explicit head_dim,
and Llama 3 rope scaling with positions past the original context (where scaling matters).
"""

from __future__ import annotations

import random

import pytest
import torch

from common.sampling_params import SamplingParams
from tests.engine.helpers import compare_greedy, hf_greedy, run_with_logits, save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama-gqa2-untied-llama3rope": ("llama", dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral-gqa4-untied": (
        "mistral",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    ),
    "qwen2-bias-tied-gqa2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm-untied-headdim": ("qwen3", dict(tie_word_embeddings=False, head_dim=32)),
    "phi3-fused-untied": ("phi3", dict(tie_word_embeddings=False)),
}
# Phi-3's LongRoPE on a pretrained context of 64: transformers switches a sequence's every
# position to the long factors once it passes 64 tokens (Baton switches per position), so these
# prompts and their tokens stay inside it, where both use the short factors and the attention factor.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0],
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_matches_transformers(case):
    kind, overrides = CASES[case]
    folder, hf = save_tiny_model(kind, **overrides)
    config = ModelConfig.from_model_dir(folder)
    assert config.tie_word_embeddings == overrides["tie_word_embeddings"]
    engine = build_engine(config, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=96), iter_safetensors(folder))
    rng = random.Random(7)
    # Lengths straddle block boundaries; 300 tokens runs well past the rope original context of 64.
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 15, 16, 17, 40, 300)]
    new_tokens = 20
    completions, logits = run_with_logits(
        engine, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    )
    with torch.inference_mode():
        refs = [_hf_no_eos(hf, p, new_tokens) for p in prompts]
    diverged = [
        i
        for i, (c, r, lg) in enumerate(zip(completions, refs, logits))
        if compare_greedy(c.token_ids, r, lg).diverged_at is not None
    ]
    assert len(diverged) <= 1, diverged


def test_phi3_longrope_inside_its_pretrained_context_matches_transformers():
    folder, hf = save_tiny_model(
        "phi3", tie_word_embeddings=False, rope_parameters=LONGROPE, original_max_position_embeddings=64
    )
    config = ModelConfig.from_model_dir(folder)
    assert (
        config.rope_scaling["rope_type"] == "longrope" and config.rope_scaling["original_max_position_embeddings"] == 64
    )
    engine = build_engine(config, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32), iter_safetensors(folder))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 16, 17, 40)]
    new_tokens = 20
    completions, logits = run_with_logits(
        engine, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    )
    with torch.inference_mode():
        refs = [_hf_no_eos(hf, p, new_tokens) for p in prompts]
    for c, r, lg in zip(completions, refs, logits):
        assert compare_greedy(c.token_ids, r, lg).diverged_at is None


def test_a_phi3_sliding_window_windows_every_layer_and_keeps_the_context():
    folder, _ = save_tiny_model("phi3", tie_word_embeddings=False, sliding_window=256)
    config = ModelConfig.from_model_dir(folder)
    assert config.max_position_embeddings == 1024 and config.layer_windows == (256, 256)


def _hf_no_eos(model, prompt, n):
    model.generation_config.eos_token_id = None
    return hf_greedy(model, prompt, n, eos_token_id=None)


def test_missing_and_unsupported_models_name_the_problem(tmp_path):
    from workers.models.files import ModelNotFoundError, resolve_model_dir

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(
        ModelNotFoundError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    ):
        resolve_model_dir(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    folder, hf = save_tiny_model("llama", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = build_engine(
        ModelConfig.from_model_dir(tmp_path), EngineConfig(num_kv_blocks=16), iter_safetensors(tmp_path)
    )
    [done] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with torch.inference_mode():
        ref = _hf_no_eos(hf, [5, 6, 7, 8], 8)
    compare_greedy(done.token_ids, ref)
