"""A LoRA adapter read from a local folder in PEFT's format, checked against the served model.

adapter_config.json gives the rank `r`, `lora_alpha`, `target_modules` and `use_rslora`;
adapter_model.safetensors holds `...layers.{i}.{self_attn|mlp}.{target}.lora_A.weight`
([rank, in]) and `lora_B.weight` ([out, rank]). An adapter is refused, with a message naming the
problem, when it targets a module Baton does not adapt, its rank is over `max_lora_rank`, it uses
a PEFT feature Baton does not serve (DoRA, biases, modules saved whole, per-module ranks), or its
matrices do not fit the served model (an adapter trained for another base model).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.lora import LORA_TARGETS, LoRAModuleSpec, lora_target_shapes
from workers.models.config import ModelConfig

__all__ = ["COLUMN_PARALLEL", "LoRAAdapter", "LoRASharding", "load_adapter", "target_shape"]

# Projections whose outputs a tensor-parallel rank splits (it keeps rows of B); the others (o_proj,
# down_proj) split their inputs (it keeps columns of A, and the all-reduce after them sums the
# ranks' updates as it sums their base products).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter in host memory: `weights[(layer, target)] = (A [rank, in], B [out, rank])`."""

    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / rank (or / sqrt(rank) with rsLoRA)
    targets: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRASharding:
    """A tensor-parallel rank's part of every adapter, as vLLM splits LoRA: B's rows of the
    column-parallel projections, A's columns of the row-parallel ones (`cuts`, per target).
    `full_config` is the whole model's, which adapters are checked against."""

    full_config: ModelConfig
    cuts: dict[str, slice]

    def cut(self, target: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        part = self.cuts.get(target)
        if part is None:
            return a, b
        if target in COLUMN_PARALLEL:
            return a, b[part].contiguous()
        return a[:, part].contiguous(), b


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) of one projection of the served model (the whole model, not a TP shard)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return lora_target_shapes(config.hidden_size, q, kv, config.intermediate_size)[target]


def _refuse(spec: LoRAModuleSpec, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {spec.name!r} ({spec.path}): {why}")


def load_adapter(spec: LoRAModuleSpec, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter `spec` names; ValueError says what is wrong with it."""
    folder = Path(spec.path)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise _refuse(spec, "not a PEFT adapter folder (needs adapter_config.json and adapter_model.safetensors)")
    try:
        meta = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise _refuse(spec, f"cannot read adapter_config.json: {exc}") from None
    if str(meta.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(spec, f"peft_type {meta.get('peft_type')!r} is not LORA")
    for key, what in (
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
    ):
        if meta.get(key):
            raise _refuse(spec, f"{what} ({key}) is not supported")
    if meta.get("bias", "none") != "none":
        raise _refuse(spec, f"bias {meta.get('bias')!r} is not supported (only 'none')")
    if meta.get("modules_to_save"):
        raise _refuse(spec, f"modules saved whole ({meta['modules_to_save']}) are not supported")
    rank = meta.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(spec, f"rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _refuse(spec, f"rank {rank} is over --max-lora-rank {max_rank}")
    targets = meta.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(LORA_TARGETS))
    if unsupported:
        raise _refuse(spec, f"unsupported target modules {unsupported}; supported: {', '.join(LORA_TARGETS)}")
    alpha = float(meta.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if meta.get("use_rslora") else alpha / rank

    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise _refuse(spec, f"cannot read adapter_model.safetensors: {exc}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise _refuse(spec, f"unexpected tensor {key!r} (only lora_A / lora_B of {', '.join(LORA_TARGETS)})")
        layer, target, half = int(m[1]), m[2], m[3]
        if target not in LORA_TARGETS:
            raise _refuse(spec, f"unsupported target module {target!r}")
        if layer >= config.num_layers:
            raise _refuse(spec, f"has layer {layer}, the served model has {config.num_layers}: another base model")
        halves.setdefault((layer, target), {})[half] = tensor.float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(spec, f"layer {layer} {target} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        width, out = target_shape(config, target)
        if a.shape != (rank, width) or b.shape != (out, rank):
            raise _refuse(
                spec,
                f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this model "
                f"(expected [{rank}, {width}] and [{out}, {rank}]): an adapter for another base model",
            )
        weights[(layer, target)] = (a.contiguous(), b.contiguous())
    if not weights:
        raise _refuse(spec, "holds no LoRA weights")
    return LoRAAdapter(
        spec.name,
        spec.path,
        rank,
        scaling,
        frozenset(t for _, t in weights),
        weights,
        spec.base_model_name or meta.get("base_model_name_or_path"),
    )
