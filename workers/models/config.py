"""The model facts the engine needs, read from a Hugging Face config.json (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workers.models.files import GEMMA_ARCHITECTURES, MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Qwen3: an RMSNorm over each query and key head (weights of head_dim) before the rotary embedding.
    qk_norm: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE; see moe_fields); num_experts 0: a dense MLP in every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP (intermediate_size)
    # A tensor-parallel rank's experts [start, stop) under expert parallelism (None: all num_experts, the
    # router always scoring all of them); set by workers.parallel.sharding.ShardPlan.
    local_experts: tuple[int, int] | None = None
    # Sliding-window attention (see attention_fields): each layer's window, in tokens a query sees
    # (itself included, transformers' convention), None for a global layer; () when every layer is global.
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    # Gemma 2: tanh soft-capping of the attention logits (inside the kernels) and of the final logits.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power (else head_dim's)
    # Gemma 3: the sliding layers' rope (rope_local_base_freq); the global layers use rope_theta / rope_scaling.
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None

    def layer_window(self, layer: int) -> int | None:
        """Tokens layer `layer`'s queries see (None: the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The window every layer shares when all layers are windowed (older KV blocks can be freed), else None."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)

    @classmethod
    def from_dict(cls, config: dict, generation_config: dict | None = None) -> ModelConfig:
        architectures = config.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures {architectures} not supported; Baton supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        activation = config.get("hidden_activation") or config.get("hidden_act", "silu")
        if arch in GEMMA_ARCHITECTURES:
            if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise ValueError(f"{arch} hidden_activation {activation!r} not supported (only gelu_pytorch_tanh)")
            activation = "gelu_pytorch_tanh"
        elif activation != "silu":
            raise ValueError(f"hidden_act {activation!r} not supported (only silu)")
        config, local_rope = _split_layer_rope(config)
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
        scaling = dict(config.get("rope_scaling") or rope or {}) or None
        max_positions = config.get("max_position_embeddings", 4096)
        if float((scaling or {}).pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(
                f"{arch} with partial_rotary_factor != 1 is not supported (rotary over the whole head only)"
            )
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "linear", "longrope"):
                raise ValueError(f"rope scaling type {kind!r} not supported (default, linear, llama3, longrope)")
            elif kind == "longrope":  # Phi-3: the factors switch at the pretrained context (kernels.rotary)
                scaling.setdefault(
                    "original_max_position_embeddings", config.get("original_max_position_embeddings", max_positions)
                )
                scaling.setdefault("max_position_embeddings", max_positions)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(config.get("attention_bias", False))
        eos = (generation_config or {}).get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            **moe_fields(arch, config),
            **attention_fields(arch, config, max_positions, local_rope),
            hidden_act=activation,
            eos_token_ids=eos_ids,
            bos_token_id=config.get("bos_token_id"),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(config, generation)


# Families whose sliding_window, when set, applies to every layer (no layer_types in their config.json).
_WINDOW_ON_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")


def _split_layer_rope(config: dict) -> tuple[dict, dict | None]:
    """Gemma 3 keeps one rope_parameters entry per layer type (transformers 5) or a separate
    rope_local_base_freq (4.x): return config with the global layers' parameters in rope_parameters,
    and the sliding layers' ({"rope_theta": ..., ...}), or None when every layer shares one rope."""
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        local = rope.get("sliding_attention")
        return {**config, "rope_parameters": rope.get("full_attention") or {}}, dict(local) if local else None
    if config.get("rope_local_base_freq") is not None:
        return config, {"rope_type": "default", "rope_theta": float(config["rope_local_base_freq"])}
    return config, None


def _layer_types(arch: str, config: dict) -> list[str]:
    """Each layer's attention type, "sliding_attention" or "full_attention" (transformers' names)."""
    layers = config["num_hidden_layers"]
    if config.get("layer_types"):
        types = list(config["layer_types"])
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        return types
    if not config.get("sliding_window"):
        return ["full_attention"] * layers
    if arch in _WINDOW_ON_EVERY_LAYER:
        return ["sliding_attention"] * layers
    if arch == "Gemma2ForCausalLM":  # transformers 4.x: even layers slide
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if arch == "Gemma3ForCausalLM":  # every sliding_window_pattern-th layer is global
        pattern = int(config.get("sliding_window_pattern") or 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if config.get("use_sliding_window"):  # Qwen2 / Qwen3 4.x: the layers from max_window_layers on
        start = int(config.get("max_window_layers") or 0)
        return ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    return ["full_attention"] * layers


def attention_fields(arch: str, config: dict, max_positions: int, local_rope: dict | None) -> dict:
    """ModelConfig's sliding-window, soft-capping and Gemma fields from config.json.

    A window no shorter than the context is no window: those layers stay global (the plain kernels).
    """
    types = _layer_types(arch, config)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{arch} attention layer types {unknown} not supported (sliding_attention, full_attention)")
    window = config.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"{arch} has sliding_attention layers but sliding_window is {window!r}")
    windows = tuple(int(window) if t == "sliding_attention" and window < max_positions else None for t in types)
    fields: dict = {"layer_windows": windows if any(w is not None for w in windows) else ()}
    if arch not in GEMMA_ARCHITECTURES:
        return fields
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention is not supported (causal attention only)")
    fields.update(
        attn_logit_softcap=_positive_or_none(config.get("attn_logit_softcapping"), "attn_logit_softcapping"),
        final_logit_softcap=_positive_or_none(config.get("final_logit_softcapping"), "final_logit_softcapping"),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or config.get("head_dim") or 256),
    )
    if arch == "Gemma3ForCausalLM":
        local = dict(local_rope or {"rope_theta": 10000.0})
        kind = local.get("rope_type", local.get("type", "default"))
        fields["local_rope_theta"] = float(local.pop("rope_theta", 10000.0))
        if kind not in ("default", "linear"):
            raise ValueError(f"{arch} sliding-layer rope type {kind!r} not supported (default, linear)")
        fields["local_rope_scaling"] = None if kind == "default" else local
    return fields


def _positive_or_none(value, name: str) -> float | None:
    if value is None:
        return None
    if not float(value) > 0:
        raise ValueError(f"{name} must be > 0 or null, got {value!r}")
    return float(value)


def moe_fields(arch: str, config: dict) -> dict:
    """ModelConfig's mixture-of-experts fields from config.json ({} for a dense family).

    Both families route by a softmax over all experts' router logits, then the top k: Mixtral
    renormalises the k probabilities (the same as a softmax over the top-k logits), Qwen3-MoE
    when norm_topk_prob is set. Qwen3-MoE's dense layers: those in mlp_only_layers, and all but
    every decoder_sparse_step-th. Neither family has shared experts.
    """
    if arch not in MOE_ARCHITECTURES:
        return {}
    # Mixtral spells it num_local_experts; Qwen3-MoE num_experts (transformers 5 saves num_local_experts).
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(
            f"{arch} needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
            f"got {experts} experts and top-k {top_k}"
        )
    layers = config["num_hidden_layers"]
    dense: tuple[int, ...] = ()
    if arch == "MixtralForCausalLM":
        inter, renormalise = config["intermediate_size"], True
    else:
        inter, renormalise = config["moe_intermediate_size"], bool(config.get("norm_topk_prob", False))
        step = int(config.get("decoder_sparse_step") or 1)
        only = {int(i) for i in (config.get("mlp_only_layers") or [])}
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    if config.get("shared_expert_intermediate_size"):
        raise ValueError(f"{arch} with shared experts (shared_expert_intermediate_size) is not supported")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(inter),
        norm_topk_prob=renormalise,
        dense_mlp_layers=dense,
    )
