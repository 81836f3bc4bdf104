"""The dense families on llama.py's `LlamaForCausalLM`: Llama, Mistral, Qwen2, Qwen3 and Phi-3.

They differ only in how config.json reads: Qwen2 always has q/k/v biases (and never o_proj's),
Qwen3 normalises each query and key head, Mistral and Phi-3 put `sliding_window` on every layer;
Phi-3's longrope scaling and fused projections are read by the generic config and loader.
"""

from __future__ import annotations

from workers.models.family import EVERY_LAYER, ModelFamily

LLAMA = "workers.models.llama:LlamaForCausalLM"


def qwen2_fields(arch: str, config: dict) -> dict:
    """Qwen2's attention has q/k/v biases whatever `attention_bias` says, and no o_proj bias."""
    return {"qkv_bias": True, "o_bias": False}


def qk_norm_fields(arch: str, config: dict) -> dict:
    """An RMSNorm over each query and key head (weights of head_dim) before the rotary embedding."""
    return {"qk_norm": True}


FAMILIES = (
    ModelFamily(
        "Llama",
        ("LlamaForCausalLM",),
        LLAMA,
        notes="`workers/models/llama.py`: GQA, Llama 3 rope scaling, optional attention and MLP biases",
    ),
    ModelFamily("Mistral", ("MistralForCausalLM",), LLAMA, window_rule=EVERY_LAYER, notes="as Llama"),
    ModelFamily("Qwen2", ("Qwen2ForCausalLM",), LLAMA, config_fields=qwen2_fields, notes="as Llama, with q/k/v biases"),
    ModelFamily(
        "Qwen3", ("Qwen3ForCausalLM",), LLAMA, config_fields=qk_norm_fields, notes="as Llama, per-head q/k RMSNorm"
    ),
    ModelFamily(
        "Phi-3",
        ("Phi3ForCausalLM",),
        LLAMA,
        window_rule=EVERY_LAYER,
        notes="as Llama, fused q/k/v and gate/up checkpoints, longrope scaling",
    ),
)
