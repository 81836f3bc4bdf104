"""What a model family is to Baton, torch-free: the `architectures` of config.json it serves, the
class that runs it (named here, imported only by `workers.models.registry.model_class`), how its
config.json becomes the family-specific fields of `ModelConfig`, and what it supports.

A family module under `workers/models/families/` declares its `FAMILIES`; `workers/models/registry.py`
lists those modules once. Everything else (the supported list of `workers.models.files`, the
per-family branches of `workers.models.config`, the loader's class and tensor-parallel checks, the
docs' model table) reads the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types
ConfigHook = Callable[[str, dict], dict]  # (architecture, config.json) -> ModelConfig fields


@dataclass(frozen=True)
class WindowRule:
    """Which layers slide when config.json sets `sliding_window` but no `layer_types` (a config
    with `layer_types` says it per layer, whatever the family)."""

    label: str  # how the docs' model table says it
    layer_types: Callable[[dict], list[str]]  # config.json (sliding_window set) -> each layer's type


def _every_layer(config: dict) -> list[str]:
    return [SLIDING] * config["num_hidden_layers"]


def _from_max_window_layers(config: dict) -> list[str]:
    """Qwen2 / Qwen3 (transformers 4.x): with use_sliding_window, the layers from max_window_layers on."""
    layers = config["num_hidden_layers"]
    if not config.get("use_sliding_window"):
        return [FULL] * layers
    start = int(config.get("max_window_layers") or 0)
    return [SLIDING if i >= start else FULL for i in range(layers)]


EVERY_LAYER = WindowRule("`sliding_window` on every layer", _every_layer)
FROM_MAX_WINDOW_LAYERS = WindowRule(
    "`use_sliding_window`: the layers from `max_window_layers` on", _from_max_window_layers
)


def no_fields(arch: str, config: dict) -> dict:
    """The config hook of a family with nothing of its own: every field is the generic reading."""
    return {}


@dataclass(frozen=True)
class ModelFamily:
    """One model family: registered once (its module's FAMILIES), read everywhere through
    `workers.models.registry`."""

    name: str  # as the docs and the README say it: "Qwen3-MoE"
    architectures: tuple[str, ...]  # config.json `architectures` entries it serves
    model_class: str  # "module:Class", the torch model (imported by registry.model_class only)
    # The family's fields of ModelConfig from config.json, over the generic reading (workers.models.config):
    # biases, q/k norms, experts, soft-capping... ValueError for what the family cannot run.
    config_fields: ConfigHook = no_fields
    window_rule: WindowRule = FROM_MAX_WINDOW_LAYERS
    activations: tuple[str, ...] = ("silu",)  # hidden_act values accepted; the first is ModelConfig.hidden_act
    tensor_parallel: bool = True  # runs sharded (workers.parallel); the loader refuses a TP group otherwise
    moe: bool = False  # mixture-of-experts MLPs (num_experts > 0)
    notes: str = field(default="", compare=False)  # what is specific to it, for the docs' model table

    def __post_init__(self) -> None:
        module, _, cls = self.model_class.partition(":")
        if not (self.name and self.architectures and module and cls):
            raise ValueError(f"a ModelFamily needs a name, architectures and model_class 'module:Class', got {self!r}")
        if not self.activations:
            raise ValueError(f"model family {self.name}: activations must name at least one")
