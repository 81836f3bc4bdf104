"""LoRA adapters by name: what `--lora-modules` names and `POST /v1/load_lora_adapter` adds.

Torch-free, so the router reads the same specs the workers load. An entry is vLLM's
`name=path` or its JSON form `{"name": ..., "path": ..., "base_model_name": ...}`; the adapter
itself is a local folder in PEFT's format (adapter_config.json + adapter_model.safetensors), never
downloaded. `LoRALimits` are the worker's `--max-loras`, `--max-lora-rank` and `--max-cpu-loras`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["LORA_TARGETS", "LoRALimits", "LoRAModuleSpec", "LoRAStatus", "lora_target_shapes", "parse_lora_modules"]

# The projections an adapter may target (PEFT's module names for the Llama family).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_target_shapes(hidden: int, q_size: int, kv_size: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of a Llama-family layer with these widths."""
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One adapter: the name requests use as their `model`, its folder, and the base model it was
    trained for (None: the served model; shown as its `root` by /v1/models)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"a LoRA adapter's name must be a non-empty string without spaces, got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LoRA adapter {self.name!r} needs a path to a local folder")

    @classmethod
    def parse(cls, entry: str) -> LoRAModuleSpec:
        """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's two forms)."""
        entry = entry.strip()
        if entry.startswith("{"):
            try:
                data = json.loads(entry)
            except json.JSONDecodeError as exc:
                raise ValueError(f"cannot read LoRA module {entry!r} as JSON: {exc}") from None
            unknown = set(data) - {"name", "path", "base_model_name"}
            if unknown or "name" not in data or "path" not in data:
                raise ValueError(
                    f"a LoRA module in JSON has keys name, path and optionally base_model_name; got {sorted(data)}"
                )
            return cls(data["name"], data["path"], data.get("base_model_name"))
        name, sep, path = entry.partition("=")
        if not sep:
            raise ValueError(f"a LoRA module is name=path or JSON, got {entry!r}")
        return cls(name.strip(), path.strip())


def parse_lora_modules(text: str | None) -> tuple[LoRAModuleSpec, ...]:
    """The adapters of `--lora-modules` (one entry per line, as the flag's values are joined)."""
    if not text:
        return ()
    specs = tuple(LoRAModuleSpec.parse(line) for line in text.splitlines() if line.strip())
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"LoRA adapter names must be unique; repeated: {', '.join(duplicates)}")
    return specs


@dataclass(frozen=True)
class LoRALimits:
    """How many adapters a worker holds: `max_loras` in a step's batch (its device slots),
    `max_lora_rank` the largest rank it takes, `max_cpu_loras` kept loaded in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and (
            not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(f"max_cpu_loras must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class LoRAStatus:
    """A worker's adapters as its stats report them: what its running and waiting requests use,
    what sits in its device slots (of `max_loras`; 0: LoRA off or no stats yet), and loads so far
    (from disk into host memory, from host memory into a slot). The router ranks workers by it (resident and
    running > resident > a free slot > must evict) and exports it as `baton:lora_requests_info`."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    resident: tuple[str, ...] = ()
    max_loras: int = 0
    disk_loads: int = 0
    slot_loads: int = 0
    # Every adapter the worker serves (from --lora-modules and run-time loads): the routers' list of
    # adapters, and the workers a request under one may go to.
    # None: not reported (the simulator's workers, which model every adapter as available).
    served: tuple[LoRAModuleSpec, ...] | None = None

    def serves(self, adapter: str | None) -> bool:
        return adapter is None or self.served is None or any(s.name == adapter for s in self.served)

    def affinity(self, adapter: str | None) -> float:
        """0 (the adapter runs here now) to 1 (a resident adapter must be evicted to load it)."""
        if adapter is None or self.max_loras == 0:
            return 0.0
        if adapter in self.running:
            return 0.0
        if adapter in self.resident:
            return 0.25
        return 0.5 if len(self.resident) < self.max_loras else 1.0
