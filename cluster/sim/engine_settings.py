"""What a simulated worker is configured with (`EngineSettings`: the engine's scheduling knobs and
LoRA's) and what it counts as it runs (`WorkerCounters`), apart from the worker itself
(cluster.sim.engine.SimWorker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.sim.lora import LoRACosts
from common.lora import LoRALimits
from workers.engine.scheduling_policy import SchedulingPolicy

__all__ = ["EngineSettings", "WorkerCounters"]


@dataclass(frozen=True)
class EngineSettings:
    """The engine knobs that shape scheduling (workers.config.EngineConfig's names), and LoRA's.

    LoRA is off unless `max_loras` (device slots, the adapters one step may run) is at least 1;
    `max_cpu_loras` adapters stay in host memory (None: max_loras, as the worker's default). The
    `lora_*` costs are model parameters (cluster.sim.lora.LoRACosts, whose docstring gives the
    defaults' reasoning), not measurements: a later benchmark of the real worker measures them."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # default: what the cost model's KV capacity holds
    scheduling_policy: str = "fcfs"  # or "priority": the real scheduler's (workers.engine.scheduling_policy)
    max_loras: int = 0  # 0: LoRA not modelled (adapters cost nothing and share no limit)
    max_cpu_loras: int | None = None
    lora_slot_load_s: float = LoRACosts.slot_load_s  # host memory -> a device slot, per adapter
    lora_disk_load_s: float = LoRACosts.disk_load_s  # disk -> host memory, per adapter
    lora_step_fraction: float = LoRACosts.step_fraction  # of a step's base time, per distinct adapter in it

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0 (0: LoRA off), got {self.max_loras!r}")
        if self.max_loras:
            LoRALimits(self.max_loras, max_cpu_loras=self.max_cpu_loras)  # checks max_cpu_loras against it
        elif self.max_cpu_loras is not None:
            raise ValueError("max_cpu_loras needs max_loras >= 1 (LoRA on)")
        LoRACosts(self.lora_slot_load_s, self.lora_disk_load_s, self.lora_step_fraction)  # checks the costs
        SchedulingPolicy(self.scheduling_policy)  # checks its name

    @property
    def lora_limits(self) -> LoRALimits | None:
        """The worker's adapter limits (None: LoRA off)."""
        if not self.max_loras:
            return None
        return LoRALimits(self.max_loras, max_cpu_loras=self.max_cpu_loras)

    @property
    def lora_costs(self) -> LoRACosts:
        return LoRACosts(self.lora_slot_load_s, self.lora_disk_load_s, self.lora_step_fraction)


@dataclass
class WorkerCounters:
    busy_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    queue_s: list[float] = field(default_factory=list)  # add to first chunk, per request
    kv_blocks_sent: int = 0
    kv_bytes_sent: int = 0
    kv_blocks_received: int = 0
