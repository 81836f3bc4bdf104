"""In which order a worker's scheduler admits waiting sequences and which running one it preempts:
`fcfs` (arrival order; the latest-arrived running sequence is preempted) or `priority` (vLLM's
`--scheduling-policy priority`: lower `priority` first; within a priority, tenants take turns by
weighted fair queuing on tokens; then the earlier TTFT target, then arrival. The lowest-priority,
latest-arrived running sequence is preempted, and a waiting sequence that finds no room preempts
running ones of a lower priority, never of its own or a higher one).

Fair queuing: each tenant has a virtual time, the tokens the pool computed for it divided by its
weight (`charge`, every step). The waiting sequence of the tenant furthest behind goes first, so
while several tenants are backlogged each gets its weight's share of the tokens; a tenant alone
gets everything (work-conserving). A tenant that comes back after being idle starts at the
backlogged tenants' earliest virtual time (`arrived`), so idleness banks no credit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping

from common.request import DEFAULT_TENANT
from workers.engine.sequence import ScheduledChunk, Sequence

__all__ = ["SCHEDULING_POLICIES", "SchedulingPolicy"]

SCHEDULING_POLICIES = ("fcfs", "priority")  # workers.config.SCHEDULING_POLICIES names them for the flag


def _priority(seq: Sequence) -> int:
    return seq.context.priority if seq.context is not None else 0


def _tenant(seq: Sequence) -> str:
    return seq.context.tenant if seq.context is not None else DEFAULT_TENANT


class SchedulingPolicy:
    def __init__(self, name: str = "fcfs", tenant_weights: Mapping[str, float] | None = None) -> None:
        if name not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")
        self.name = name
        self.by_priority = name == "priority"
        self.weights = dict(tenant_weights or {})
        self.vtime: dict[str, float] = {}  # per tenant: tokens computed for it / its weight

    def key(self, seq: Sequence) -> tuple[int, float, float, float]:
        """A waiting sequence's place under the priority policy: priority, then its tenant's virtual
        time (which moves as tenants are served), then its TTFT target, then arrival."""
        ctx = seq.context
        target = ctx.ttft_target if ctx is not None and ctx.ttft_target is not None else math.inf
        return (_priority(seq), self.vtime.get(_tenant(seq), 0.0), target, seq.arrival_time)

    def next_waiting(self, waiting: deque[Sequence]) -> Sequence:
        """The waiting sequence to admit next (waiting must not be empty): the first in line under
        fcfs, the lowest `key` under priority (the line's order then does not matter)."""
        if not self.by_priority:
            return waiting[0]
        return min(waiting, key=self.key)

    def arrived(self, seq: Sequence, present: Iterable[Sequence]) -> None:
        """A new sequence: its tenant, idle until now, starts at the backlogged tenants' earliest
        virtual time (or where the others are, when none is backlogged)."""
        tenant = _tenant(seq)
        active = {_tenant(s) for s in present}
        if tenant in active:
            return
        times = [self.vtime.get(t, 0.0) for t in active] or list(self.vtime.values()) or [0.0]
        self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), min(times) if active else max(times))

    def charge(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Count a step's tokens against their tenants' virtual times."""
        for chunk in chunks:
            tenant = _tenant(chunk.seq)
            self.vtime[tenant] = self.vtime.get(tenant, 0.0) + chunk.num_tokens / self.weights.get(tenant, 1.0)

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, front: bool = False) -> None:
        """Put seq in line: at the back, or (front: a preempted one) at the front. Under priority
        `next_waiting` picks by `key` whatever the line's order; a preempted sequence keeps its
        arrival, so its place."""
        (waiting.appendleft if front else waiting.append)(seq)

    def victim(self, running: Iterable[Sequence]) -> Sequence | None:
        """Of the candidates, the one to preempt first (None when there is none)."""
        candidates = list(running)
        if not candidates:
            return None
        if not self.by_priority:
            return candidates[-1]  # the latest arrived (the running list is in admission order)
        return max(reversed(candidates), key=lambda s: (_priority(s), s.arrival_time))

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether `waiting` may preempt `running` to start: only under priority, and only a lower priority."""
        return self.by_priority and _priority(waiting) < _priority(running)
