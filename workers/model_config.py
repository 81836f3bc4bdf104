"""The model facts the engine needs, read from a Hugging Face config.json (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workers.model_files import SUPPORTED_ARCHITECTURES


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

    @classmethod
    def from_dict(cls, config: dict, generation_config: dict | None = None) -> "ModelConfig":
        architectures = config.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"architectures {architectures} not supported; Baton supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} not supported (only silu)")
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
        scaling = config.get("rope_scaling") or rope or None
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "linear"):
                raise ValueError(f"rope scaling type {kind!r} not supported (default, linear, llama3)")
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
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=config.get("bos_token_id"),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(config, generation)
