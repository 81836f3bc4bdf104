"""LoRA adapters on a simulated worker: which are in its device slots and host memory, and what
loading them and running them costs a step.

`AdapterResidency` keeps the same three tiers, with the same rules, as the real worker's
`workers.lora.manager.LoRAManager`: any adapter a request names is served (a simulated worker
needs no `--lora-modules`); at most `max_cpu_loras` are held in host memory (least recently
loaded into a slot evicted first, read from disk again when next wanted); at most `max_loras` sit
in device slots. The real `Scheduler` (built with `max_adapters=max_loras`) admits at most that
many distinct adapters to a step, so a step's adapters always fit: `load_for` puts each one not
resident into a free slot, else the least recently used slot the step does not need, as
`LoRAManager.slots_for` does, and counts a slot load for each (plus a disk load for each not in
host memory).

What that costs (`LoRACosts`, from `EngineSettings`) is the simulator's model, not a measurement:

    t = t_base · (1 + step_fraction · A) + slot_load_s · (slot loads) + disk_load_s · (disk loads)

A: the distinct adapters in the step's batch; a step of base-model rows only costs t_base exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.lora import LoRALimits, LoRAStatus

__all__ = ["AdapterResidency", "LoRACosts", "LoRACounters"]


@dataclass(frozen=True)
class LoRACosts:
    """The LoRA model's costs. Model parameters, not measurements: the defaults are estimates for a
    rank-16 adapter on every projection of Llama 3.1 8B (42 M parameters, 84 MB in bf16) on an
    H100-class GPU, until a benchmark of the real worker measures them.

    slot_load_s: copying one adapter from host memory into a device slot (84 MB over PCIe at
      ~25 GB/s plus the per-projection copies); the step that needs it waits this long;
    disk_load_s: reading one adapter from disk into host memory first (safetensors at ~2 GB/s);
    step_fraction: each distinct adapter in a step's batch adds this fraction of the step's
      base-model time (the adapters' shrink/expand kernels and weight reads)."""

    slot_load_s: float = 0.005
    disk_load_s: float = 0.05
    step_fraction: float = 0.05

    def __post_init__(self) -> None:
        for name in ("slot_load_s", "disk_load_s", "step_fraction"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"LoRA cost {name} must be a number >= 0, got {value!r}")

    def step_time(self, base_s: float, adapters: int, slot_loads: int, disk_loads: int) -> float:
        """A step's seconds: its base-model time stretched by its adapters, plus the loads it waited for."""
        if not (adapters or slot_loads or disk_loads):
            return base_s
        loads_s = self.slot_load_s * slot_loads + self.disk_load_s * disk_loads
        return base_s * (1 + self.step_fraction * adapters) + loads_s


@dataclass
class LoRACounters:
    """What one worker's adapters did: loads by adapter, seconds steps waited for loads, and steps by
    how many distinct adapters their batch held (0: base-model rows only)."""

    slot_loads: dict[str, int] = field(default_factory=dict)
    disk_loads: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0
    steps_by_adapters: dict[int, int] = field(default_factory=dict)


class AdapterResidency:
    """One worker's adapters: host memory and device slots, as `LoRAManager` keeps them."""

    def __init__(self, limits: LoRALimits, costs: LoRACosts) -> None:
        self.limits = limits
        self.costs = costs
        self.host: OrderedDict[str, None] = OrderedDict()
        self.slot_names: list[str | None] = [None] * limits.max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(limits.max_loras))
        self.counters = LoRACounters()

    @property
    def resident(self) -> list[str]:
        """Adapters in a device slot now (slot order)."""
        return [n for n in self.slot_names if n is not None]

    def add(self, name: str) -> None:
        """`load_lora_adapter`: read into host memory now (as `LoRAManager.add`; not counted as a load)."""
        self.remove(name)
        self._keep_in_host(name)

    def remove(self, name: str) -> bool:
        """`unload_lora_adapter`: out of host memory and its slot. True if it was in either."""
        known = name in self.host
        self.host.pop(name, None)
        for i, slot_name in enumerate(self.slot_names):
            if slot_name == name:
                self.slot_names[i] = None
                known = True
        return known

    def _keep_in_host(self, name: str) -> None:
        self.host[name] = None
        self.host.move_to_end(name)
        while len(self.host) > self.limits.host_capacity:
            self.host.popitem(last=False)

    def load_for(self, names: Iterable[str | None]) -> tuple[int, int, int]:
        """A step's adapters (one name per chunk, None: base model) into slots: (distinct adapters,
        slot loads, disk loads)."""
        wanted = {n for n in names if n is not None}
        c = self.counters
        c.steps_by_adapters[len(wanted)] = c.steps_by_adapters.get(len(wanted), 0) + 1
        if not wanted:
            return 0, 0, 0
        if len(wanted) > self.limits.max_loras:  # the scheduler's max_adapters keeps this from happening
            raise AssertionError(f"a step with {len(wanted)} adapters; max_loras is {self.limits.max_loras}")
        slot_of = {n: i for i, n in enumerate(self.slot_names) if n in wanted}
        slot_loads = disk_loads = 0
        for name in sorted(wanted - set(slot_of)):
            empty = [i for i in self._slot_use if self.slot_names[i] is None]
            free = empty[0] if empty else next(i for i in self._slot_use if self.slot_names[i] not in wanted)
            if name not in self.host:
                disk_loads += 1
                c.disk_loads[name] = c.disk_loads.get(name, 0) + 1
            self._keep_in_host(name)
            self.slot_names[free] = name
            slot_loads += 1
            c.slot_loads[name] = c.slot_loads.get(name, 0) + 1
            slot_of[name] = free
        for i in slot_of.values():
            self._slot_use.move_to_end(i)
        c.load_s += self.costs.slot_load_s * slot_loads + self.costs.disk_load_s * disk_loads
        return len(wanted), slot_loads, disk_loads

    def status(self, running: Iterable[str | None], waiting: Iterable[str | None]) -> LoRAStatus:
        """What the worker's stats report (as `LLMEngine._lora_status`)."""
        c = self.counters
        return LoRAStatus(
            running=tuple(sorted({n for n in running if n is not None})),
            waiting=tuple(sorted({n for n in waiting if n is not None})),
            resident=tuple(self.resident),
            max_loras=self.limits.max_loras,
            disk_loads=sum(c.disk_loads.values()),
            slot_loads=sum(c.slot_loads.values()),
        )
