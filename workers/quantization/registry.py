"""Weight quantization methods, by the name the configuration gives them (`--quantization`,
`EngineConfig.quantization`: vLLM's names) and by the `quant_method` of the checkpoints they read.

Torch-free: `workers.config` (and so the `baton` CLI and its JSON Schema) reads the names here
without loading torch. A method's implementation is named ("module:attribute", an object that
satisfies `QuantizationMethod`) and imported on first use, as vLLM's registries do.

Adding a method: a module under workers/quantization/ with an object satisfying QuantizationMethod,
and one `register_quantization(...)` line at the bottom of this file. An unknown name in the
configuration is refused, naming the field and the known methods; a checkpoint whose
`quantization_config.quant_method` no method reads is refused the same way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class QuantizationMethod(Protocol):
    """What a quantization method gives the loader (workers.engine.loader), on the torch modules of
    a model built on the meta device (`prepare_checkpoint`) or loaded in float (`quantize`)."""

    def parse_checkpoint(self, quantization_config: dict) -> Any:
        """A checkpoint's config.json `quantization_config` -> the scheme prepare_checkpoint takes;
        ValueError, naming what is supported, for anything the method cannot load exactly."""

    def prepare_checkpoint(self, model: Any, scheme: Any, ops: Any = None) -> int:
        """Make the layers a pre-quantized checkpoint's tensors load into; returns how many."""

    def quantize(self, model: Any, ops: Any = None) -> int:
        """Quantize a loaded float model's weights in place (load-time quantization); returns how
        many linear layers it replaced."""

    def cast(self, model: Any, dtype: Any) -> Any:
        """model.to(dtype), leaving the method's quantized weights and scales as they are."""

    def weight_memory(self, model: Any) -> Any:
        """The bytes the model's weights hold, linear layers apart (a WeightMemory)."""


@dataclass(frozen=True)
class QuantizationEntry:
    """A registered method: its names (torch-free) and its implementation (imported on first use)."""

    name: str  # the configuration's name for it
    implementation: str | QuantizationMethod = field(repr=False)  # "module:attribute" or the object
    checkpoint_formats: tuple[str, ...] = ()  # quantization_config.quant_method values it loads
    help: str = ""  # what `--quantization NAME` does, for the CLI and the schema

    def method(self) -> QuantizationMethod:
        impl = self.implementation
        if isinstance(impl, str):
            module, _, attribute = impl.partition(":")
            impl = getattr(importlib.import_module(module), attribute)
        if not isinstance(impl, QuantizationMethod):
            raise TypeError(f"quantization method {self.name!r}: {impl!r} does not provide QuantizationMethod")
        return impl


_METHODS: dict[str, QuantizationEntry] = {}


def register_quantization(
    name: str, implementation: str | QuantizationMethod, *, checkpoint_formats: tuple[str, ...] = (), help: str = ""
) -> QuantizationEntry:
    """Register a method under the configuration name `name`; ValueError when a name or a checkpoint
    format is taken already."""
    if not name or name in _METHODS:
        raise ValueError(f"quantization method {name!r} is registered already (or empty)")
    taken = [f for f in checkpoint_formats if f in checkpoint_formats_known()]
    if taken:
        raise ValueError(f"checkpoint formats {taken} are read by another quantization method already")
    entry = QuantizationEntry(name, implementation, tuple(checkpoint_formats), help)
    _METHODS[name] = entry
    return entry


def unregister_quantization(name: str) -> None:
    """Remove a method registered at run time (tests)."""
    del _METHODS[name]


def quantization_names() -> tuple[str, ...]:
    """The configuration's names, in registration order."""
    return tuple(_METHODS)


def checkpoint_formats_known() -> tuple[str, ...]:
    return tuple(f for entry in _METHODS.values() for f in entry.checkpoint_formats)


def quantization_help() -> str:
    """The `--quantization` help: each method's own."""
    return "; ".join(f"{e.name}: {e.help}" for e in _METHODS.values())


def check_quantization(name: str | None, field_name: str = "quantization") -> None:
    """None (no quantization) or a registered name; else ValueError naming the field and the known methods."""
    if name is not None and name not in _METHODS:
        known = " or ".join(repr(n) for n in _METHODS)
        raise ValueError(
            f"{field_name} must be null or {known} (the known quantization methods: "
            f"workers/quantization/registry.py), got {name!r}"
        )


def quantization_method(name: str, field_name: str = "quantization") -> QuantizationMethod:
    """The method registered as `name` (its module imported now)."""
    check_quantization(name, field_name)
    return _METHODS[name].method()


@dataclass(frozen=True)
class CheckpointScheme:
    """How a pre-quantized checkpoint is quantized: the method that reads it and its parsed scheme."""

    name: str  # the method's configuration name
    method: QuantizationMethod
    scheme: Any


def checkpoint_quantization(quantization_config: dict | None) -> CheckpointScheme | None:
    """The method and scheme of a checkpoint's config.json `quantization_config`; None for a float
    checkpoint. ValueError naming the formats the methods read when none reads it."""
    if not quantization_config:
        return None
    quant_method = quantization_config.get("quant_method")
    entry = next((e for e in _METHODS.values() if quant_method in e.checkpoint_formats), None)
    if entry is None:
        raise ValueError(
            f"quantization_config.quant_method {quant_method!r} is not supported; "
            f"supported: {', '.join(checkpoint_formats_known())}"
        )
    method = entry.method()
    return CheckpointScheme(entry.name, method, method.parse_checkpoint(quantization_config))


# The built-in methods, one line each.
register_quantization(
    "fp8",
    "workers.quantization.fp8:FP8",
    checkpoint_formats=("fp8", "compressed-tensors"),
    help="quantize every linear layer to FP8 (e4m3, per-channel scales) at load time; "
    "FP8 checkpoints load as FP8 without it",
)
