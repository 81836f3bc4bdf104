"""The model facts the engine needs, read from a Hugging Face config.json (transformers 4.x and 5.x spellings).

The reading here is generic; what is specific to a family (biases, q/k norms, experts, soft-capping,
which layers slide) is its `ModelFamily`'s (workers.models.registry): its config hook's fields win.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workers.models.family import FULL, SLIDING, ModelFamily
from workers.models.registry import UnsupportedArchitecture, family_for, find_architecture, supported_list


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
    # Mixture of experts (workers/models/families/moe.py); num_experts 0: a dense MLP in every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP (intermediate_size)
    # A tensor-parallel rank's experts [start, stop) under expert parallelism (None: all num_experts, the
    # router always scoring all of them); set by workers.parallel.sharding.ShardPlan.
    local_experts: tuple[int, int] | None = None
    # Sliding-window attention (see layer_windows): each layer's window, in tokens a query sees
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
        return max(w for w in self.layer_windows if w is not None)

    @classmethod
    def from_dict(cls, config: dict, generation_config: dict | None = None) -> ModelConfig:
        architectures = config.get("architectures") or []
        arch = find_architecture(architectures)
        if arch is None:
            raise UnsupportedArchitecture(
                f"architectures {architectures} not supported; Baton supports {supported_list()}"
            )
        family = family_for(arch)
        activation = config.get("hidden_activation") or config.get("hidden_act", "silu")
        if activation not in family.activations:
            raise ValueError(f"{arch} hidden_act {activation!r} not supported (only {', '.join(family.activations)})")
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = _rope_parameters(config)
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
        attention_bias = bool(config.get("attention_bias", False))
        eos = (generation_config or {}).get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        fields = dict(
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
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            layer_windows=layer_windows(family, arch, config, max_positions),
            hidden_act=family.activations[0],
            eos_token_ids=eos_ids,
            bos_token_id=config.get("bos_token_id"),
        )
        fields.update(family.config_fields(arch, config))  # the family's own reading wins
        return cls(**fields)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(config, generation)


def _rope_parameters(config: dict) -> dict:
    """transformers 5's rope_parameters; with one entry per layer type (Gemma 3), the global layers'
    (the sliding layers' rope is the family's: workers/models/families/gemma.py)."""
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return dict(rope.get("full_attention") or {})
    return dict(rope)


def _layer_types(family: ModelFamily, config: dict) -> list[str]:
    """Each layer's attention type, "sliding_attention" or "full_attention" (transformers' names):
    config.json's `layer_types`, else the family's rule when `sliding_window` is set."""
    layers = config["num_hidden_layers"]
    if config.get("layer_types"):
        types = list(config["layer_types"])
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        return types
    if not config.get("sliding_window"):
        return [FULL] * layers
    return family.window_rule.layer_types(config)


def layer_windows(family: ModelFamily, arch: str, config: dict, max_positions: int) -> tuple[int | None, ...]:
    """ModelConfig.layer_windows from config.json: each layer's window, () when none slides.

    A window no shorter than the context is no window: those layers stay global (the plain kernels).
    """
    types = _layer_types(family, config)
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"{arch} attention layer types {unknown} not supported (sliding_attention, full_attention)")
    window = config.get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"{arch} has sliding_attention layers but sliding_window is {window!r}")
    windows = tuple(
        int(window) if t == SLIDING and isinstance(window, int) and window < max_positions else None for t in types
    )
    return windows if any(w is not None for w in windows) else ()
