"""The mixture-of-experts families on moe.py's `MoeForCausalLM`: Mixtral and Qwen3-MoE.

Both route by a softmax over all experts' router logits, then the top k: Mixtral renormalises the
k probabilities (the same as a softmax over the top-k logits), Qwen3-MoE when norm_topk_prob is
set. Qwen3-MoE's dense layers: those in mlp_only_layers, and all but every decoder_sparse_step-th.
Neither family has shared experts.
"""

from __future__ import annotations

from workers.models.family import EVERY_LAYER, ModelFamily

MOE = "workers.models.moe:MoeForCausalLM"


def _routing(arch: str, config: dict) -> tuple[int, int]:
    """(experts, top k), checked. Mixtral spells it num_local_experts; Qwen3-MoE num_experts
    (transformers 5 saves num_local_experts)."""
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(
            f"{arch} needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
            f"got {experts} experts and top-k {top_k}"
        )
    return experts, top_k


def _no_shared_experts(arch: str, config: dict) -> None:
    if config.get("shared_expert_intermediate_size"):
        raise ValueError(f"{arch} with shared experts (shared_expert_intermediate_size) is not supported")


def mixtral_fields(arch: str, config: dict) -> dict:
    experts, top_k = _routing(arch, config)
    inter = config["intermediate_size"]
    _no_shared_experts(arch, config)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(inter), norm_topk_prob=True)


def qwen3_moe_fields(arch: str, config: dict) -> dict:
    experts, top_k = _routing(arch, config)
    inter = config["moe_intermediate_size"]
    step = int(config.get("decoder_sparse_step") or 1)
    only = {int(i) for i in (config.get("mlp_only_layers") or [])}
    dense = tuple(i for i in range(config["num_hidden_layers"]) if i in only or (i + 1) % step != 0)
    _no_shared_experts(arch, config)
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(inter),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        dense_mlp_layers=dense,
        qk_norm=True,
    )


FAMILIES = (
    ModelFamily(
        "Mixtral",
        ("MixtralForCausalLM",),
        MOE,
        config_fields=mixtral_fields,
        window_rule=EVERY_LAYER,
        moe=True,
        notes="`workers/models/moe.py`: llama.py's attention and norms, a mixture-of-experts MLP in every layer "
        "(router softmax, top-k renormalised; `kernels/fused_moe.py`: Triton grouped GEMMs on CUDA, per-expert "
        "batched matmuls on the CPU); `--quantization fp8` quantizes the experts per expert and row, and "
        "pre-quantized per-expert FP8 checkpoints (block, channel or tensor scales) load as they are; with "
        "tensor parallelism the experts split by channel or whole (`--enable-expert-parallel`)",
    ),
    ModelFamily(
        "Qwen3-MoE",
        ("Qwen3MoeForCausalLM",),
        MOE,
        config_fields=qwen3_moe_fields,
        moe=True,
        notes="as Mixtral, with Qwen3's per-head q/k RMSNorm, `norm_topk_prob`, dense MLP layers from "
        "`mlp_only_layers` / `decoder_sparse_step`; no shared experts",
    ),
)
