"""The simulation's clock: a heap of timed callbacks.

`EventLoop.now` is the simulated time in seconds; callbacks at the same time run in the order they
were scheduled. Simulations schedule an event or two per token, so the hot paths are written out.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

__all__ = ["EventLoop"]


class EventLoop:
    """A heap of timed callbacks; `now` is the simulated time in seconds. Callbacks at the same
    time run in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._pushes = 0  # callbacks scheduled so far: each one's place in the order of a tie
        self._open_group: tuple[int, float, Callable, list] | None = None  # see after_grouped

    def at(self, t: float, fn: Callable, *args) -> None:
        now = self.now
        self._pushes += 1
        heapq.heappush(self._heap, (t if t > now else now, self._pushes, fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        # at(now + dt) written out: a simulation schedules an event or two per token.
        now = self.now
        t = now + dt
        self._pushes += 1
        heapq.heappush(self._heap, (t if t > now else now, self._pushes, fn, args))

    def after_grouped(self, dt: float, fn: Callable, *args) -> None:
        """after(dt, fn, *args), in one heap entry with the previous call when that was to the same
        fn at the same time and nothing was scheduled in between (a step's outputs, one per
        sequence): the calls run back to back at that time either way, in the same order."""
        now = self.now
        t = now + dt
        t = t if t > now else now
        group = self._open_group
        if group is not None and group[0] == self._pushes and group[1] == t and group[2] == fn:
            group[3].append(args)
            return
        calls = [args]
        self._pushes += 1
        heapq.heappush(self._heap, (t, self._pushes, self._run_group, (fn, calls)))
        self._open_group = (self._pushes, t, fn, calls)

    def _run_group(self, fn: Callable, calls: list) -> None:
        if self._open_group is not None and self._open_group[3] is calls:
            self._open_group = None  # running: a call scheduled from now on goes after what is queued
        for args in calls:
            fn(*args)

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        heap, pop = self._heap, heapq.heappop
        limit = math.inf if until is None else until
        while heap:
            if heap[0][0] > limit:
                self.now = limit
                return
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            if stop is not None and stop():
                return

    def __len__(self) -> int:
        return len(self._heap)
