"""Gemma 2 and Gemma 3 (text) on gemma.py's `GemmaForCausalLM`.

config.json: GeGLU (`gelu_pytorch_tanh`), `query_pre_attn_scalar`, attention and final logit
soft-capping (Gemma 2), per-head q/k RMSNorm and a rope of their own for the sliding layers
(Gemma 3: `rope_parameters.sliding_attention` in transformers 5, `rope_local_base_freq` in 4.x).
Without `layer_types` (transformers 4.x), Gemma 2's even layers slide and Gemma 3's all but every
`sliding_window_pattern`-th.
"""

from __future__ import annotations

from workers.models.family import FULL, SLIDING, ModelFamily, WindowRule

GEMMA = "workers.models.gemma:GemmaForCausalLM"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def _positive_or_none(value, name: str) -> float | None:
    if value is None:
        return None
    if not float(value) > 0:
        raise ValueError(f"{name} must be > 0 or null, got {value!r}")
    return float(value)


def gemma_fields(arch: str, config: dict) -> dict:
    """Soft-capping and the attention scale, shared by both generations."""
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention is not supported (causal attention only)")
    return dict(
        attn_logit_softcap=_positive_or_none(config.get("attn_logit_softcapping"), "attn_logit_softcapping"),
        final_logit_softcap=_positive_or_none(config.get("final_logit_softcapping"), "final_logit_softcapping"),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or config.get("head_dim") or 256),
    )


def _local_rope(config: dict) -> dict:
    """The sliding layers' rope parameters ({"rope_theta": ..., ...})."""
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return dict(rope.get("sliding_attention") or {"rope_theta": 10000.0})
    if config.get("rope_local_base_freq") is not None:
        return {"rope_type": "default", "rope_theta": float(config["rope_local_base_freq"])}
    return {"rope_theta": 10000.0}


def gemma3_fields(arch: str, config: dict) -> dict:
    fields = gemma_fields(arch, config)
    local = _local_rope(config)
    kind = local.get("rope_type", local.get("type", "default"))
    fields["local_rope_theta"] = float(local.pop("rope_theta", 10000.0))
    if kind not in ("default", "linear"):
        raise ValueError(f"{arch} sliding-layer rope type {kind!r} not supported (default, linear)")
    fields["local_rope_scaling"] = None if kind == "default" else local
    fields["qk_norm"] = True
    return fields


def _even_layers(config: dict) -> list[str]:
    return [SLIDING if i % 2 == 0 else FULL for i in range(config["num_hidden_layers"])]


def _pattern(config: dict) -> list[str]:
    pattern = int(config.get("sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config["num_hidden_layers"])]


FAMILIES = (
    ModelFamily(
        "Gemma 2",
        ("Gemma2ForCausalLM",),
        GEMMA,
        config_fields=gemma_fields,
        window_rule=WindowRule("even layers", _even_layers),
        activations=ACTIVATIONS,
        tensor_parallel=False,
        notes="`workers/models/gemma.py`: embeddings scaled by sqrt(hidden), GeGLU (`gelu_pytorch_tanh`), norms "
        "before and after attention and MLP with Gemma's (1 + w) weights, `query_pre_attn_scalar`, attention "
        "logit soft-capping inside the attention kernels, final logit soft-capping",
    ),
    ModelFamily(
        "Gemma 3",
        ("Gemma3ForCausalLM",),  # the text-only model
        GEMMA,
        config_fields=gemma3_fields,
        window_rule=WindowRule("all but every `sliding_window_pattern`-th layer", _pattern),
        activations=ACTIVATIONS,
        tensor_parallel=False,
        notes="text only; as Gemma 2 without soft-capping, plus per-head q/k RMSNorm and a separate rope base for "
        "the sliding layers (two rope tables)",
    ),
)
