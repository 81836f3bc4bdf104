"""Where a worker's adapters are: known by name, loaded in host memory, resident in device slots.

Three tiers, as vLLM and S-LoRA keep them: the adapters a worker may serve (`specs`: names and
folders, from `--lora-modules` and run-time loads), those read into host memory (at most
`max_cpu_loras`, least recently used evicted, read again from disk when next wanted), and those in
the `max_loras` device slots a step's batch draws from. Each projection of each layer has one
stacked A [slots, max_rank, in] and B [slots, out, max_rank] (a smaller rank zero-padded), so
one kernel call serves a batch that mixes adapters and the base model (kernels/lora.py).

`slots_for(names)` is called once per step with each chunk's adapter; the scheduler admits at
most `max_loras` distinct adapters to a step, so the slots always suffice, and a slot is reused
least recently used first, never one the step needs.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from common.lora import LORA_TARGETS, LoRALimits, LoRAModuleSpec
from workers.lora.adapter import LoRAAdapter, LoRASharding, load_adapter, target_shape
from workers.models.config import ModelConfig

__all__ = ["LoRAManager", "LoRAStats"]


class LoRAStats:
    """Counts a worker reports: adapters read from disk, and copied into a device slot."""

    def __init__(self) -> None:
        self.disk_loads = 0
        self.slot_loads = 0


class LoRAManager:
    def __init__(
        self,
        config: ModelConfig,
        limits: LoRALimits,
        specs: Sequence[LoRAModuleSpec] = (),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sharding: LoRASharding | None = None,
    ) -> None:
        """`config` is the model the projections have (a tensor-parallel rank's shard); `sharding`
        cuts each adapter to it and holds the whole model's config to check adapters against."""
        self.config = config
        self.sharding = sharding
        self.limits = limits
        self.dtype = dtype
        self.device = torch.device(device)
        self.specs: dict[str, LoRAModuleSpec] = {}
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slot_names: list[str | None] = [None] * limits.max_loras
        self.slot_targets: list[frozenset[str]] = [frozenset()] * limits.max_loras  # what each slot's adapter adapts
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(limits.max_loras))
        r, n = limits.max_lora_rank, limits.max_loras
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(config.num_layers):
            for target in LORA_TARGETS:
                width, out = target_shape(config, target)
                self.a[(layer, target)] = torch.zeros((n, r, width), dtype=dtype, device=self.device)
                self.b[(layer, target)] = torch.zeros((n, out, r), dtype=dtype, device=self.device)
        self.scaling = torch.zeros(n, dtype=torch.float32, device=self.device)
        # Row -> slot of the step being run (-1: base model), set by the model runner before each
        # forward, and the targets the step's adapters adapt (the others are skipped).
        self.row_slots: torch.Tensor | None = None
        self.active_targets: frozenset[str] = frozenset()
        self.stats = LoRAStats()
        for spec in specs:
            self.add(spec)

    # ---- the adapters a worker serves ----------------------------------------------------------
    def _read(self, spec: LoRAModuleSpec) -> LoRAAdapter:
        """The adapter from its folder, checked against the whole model and cut to this rank's part."""
        full = self.sharding.full_config if self.sharding is not None else self.config
        adapter = load_adapter(spec, full, self.limits.max_lora_rank)
        if self.sharding is None:
            return adapter
        cut = self.sharding.cut
        weights = {key: cut(key[1], a, b) for key, (a, b) in adapter.weights.items()}
        return dataclasses.replace(adapter, weights=weights)

    def add(self, spec: LoRAModuleSpec) -> LoRAAdapter:
        """Serve `spec` from now on; it is read and checked now (ValueError names what is wrong)."""
        adapter = self._read(spec)
        self.remove(spec.name)
        self.specs[spec.name] = spec
        self._keep_in_host(adapter)
        return adapter

    def remove(self, name: str) -> bool:
        """Stop serving `name` (its slot and host copy freed). False if it was not served."""
        known = self.specs.pop(name, None) is not None
        self.host.pop(name, None)
        for i, slot_name in enumerate(self.slot_names):
            if slot_name == name:
                self.slot_names[i] = None
                self.slot_targets[i] = frozenset()
                self.scaling[i] = 0.0
        return known

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    @property
    def resident(self) -> list[str]:
        """Adapters in a device slot now."""
        return [n for n in self.slot_names if n is not None]

    def _keep_in_host(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.limits.host_capacity:
            self.host.popitem(last=False)

    def _host_copy(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:
            adapter = self._read(self.specs[name])
            self.stats.disk_loads += 1
        self._keep_in_host(adapter)
        return adapter

    # ---- device slots --------------------------------------------------------------------------
    def slots_for(self, names: Sequence[str | None]) -> list[int]:
        """The slot of each name (-1 for the base model), loading into slots what is not resident."""
        wanted = {n for n in names if n is not None}
        if len(wanted) > self.limits.max_loras:
            raise ValueError(f"a step with {len(wanted)} adapters; max_loras is {self.limits.max_loras}")
        unknown = sorted(wanted - set(self.specs))
        if unknown:
            raise ValueError(f"unknown LoRA adapter(s) {unknown}")
        slot_of = {n: i for i, n in enumerate(self.slot_names) if n in wanted}
        for name in sorted(wanted - set(slot_of)):
            free = next(
                (i for i in self._slot_use if self.slot_names[i] is None),
                next(i for i in self._slot_use if self.slot_names[i] not in wanted),
            )
            self._load_slot(free, self._host_copy(name))
            slot_of[name] = free
        for i in slot_of.values():
            self._slot_use.move_to_end(i)
        return [-1 if n is None else slot_of[n] for n in names]

    def targets_of(self, slots: Iterable[int]) -> frozenset[str]:
        """The targets the adapters in `slots` adapt (-1, the base model, adapts none)."""
        out: frozenset[str] = frozenset()
        for s in set(slots):
            if s >= 0:
                out |= self.slot_targets[s]
        return out

    def slot_table(self) -> tuple[LoRAModuleSpec | None, ...]:
        """Which adapter each device slot holds: what the other ranks of a tensor-parallel group
        copy (`adopt`) so that a step's row slots mean the same adapters on every rank."""
        return tuple(None if n is None else self.specs[n] for n in self.slot_names)

    def adopt(self, table: tuple[LoRAModuleSpec | None, ...]) -> None:
        """Hold in each slot what rank 0's `slot_table` says (loading what differs)."""
        for slot, spec in enumerate(table):
            if spec is None or self.slot_names[slot] == spec.name:
                continue
            if self.specs.get(spec.name) != spec:
                self.add(spec)  # loaded at run time on rank 0
            self._load_slot(slot, self._host_copy(spec.name))

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for key, a_stack in self.a.items():
            b_stack = self.b[key]
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            pair = adapter.weights.get(key)
            if pair is not None:
                a, b = pair
                a_stack[slot, : adapter.rank].copy_(a)
                b_stack[slot, :, : adapter.rank].copy_(b)
        self.scaling[slot] = adapter.scaling
        self.slot_names[slot] = adapter.name
        self.slot_targets[slot] = adapter.targets
        self.stats.slot_loads += 1
