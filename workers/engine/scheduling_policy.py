"""In which order a worker's scheduler admits waiting sequences and which running one it preempts:
`fcfs` (arrival order; the latest-arrived running sequence is preempted) or `priority` (vLLM's
`--scheduling-policy priority`: lower `priority` first, then the earlier TTFT target, then arrival;
the lowest-priority, latest-arrived running sequence is preempted, and a waiting sequence that
finds no room preempts running ones of a lower priority, never of its own or a higher one).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable

from workers.engine.sequence import Sequence

__all__ = ["SCHEDULING_POLICIES", "SchedulingPolicy"]

SCHEDULING_POLICIES = ("fcfs", "priority")  # workers.config.SCHEDULING_POLICIES names them for the flag


def _priority(seq: Sequence) -> int:
    return seq.context.priority if seq.context is not None else 0


class SchedulingPolicy:
    def __init__(self, name: str = "fcfs") -> None:
        if name not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")
        self.name = name
        self.by_priority = name == "priority"

    def key(self, seq: Sequence) -> tuple[int, float, float]:
        """A waiting sequence's place: priority, then its TTFT target, then arrival."""
        ctx = seq.context
        target = ctx.ttft_target if ctx is not None and ctx.ttft_target is not None else math.inf
        return (_priority(seq), target, seq.arrival_time)

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, front: bool = False) -> None:
        """Put seq in line: at the back (front: a preempted one, at the front) under fcfs, in key
        order under priority (a preempted sequence keeps its arrival, so its place)."""
        if not self.by_priority:
            (waiting.appendleft if front else waiting.append)(seq)
            return
        keys = [self.key(s) for s in waiting]
        waiting.insert(bisect.bisect_right(keys, self.key(seq)), seq)

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
