"""Simulated clients: when each request of a workload is sent.

A closed-loop client keeps `concurrency` units (conversations) in flight and starts the next one
when one ends; an open-loop client (no concurrency) starts each unit at its first request's arrival
time. Within a unit, each request is sent `think_s` after the one before it ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from cluster.sim.events import EventLoop
from cluster.sim.workload import Client, SimRequest

__all__ = ["start_client"]

# (client name, request, call when it ends)
Send = Callable[[str, SimRequest, Callable[[], None]], None]


def start_client(loop: EventLoop, client: Client, send: Send, closed: Callable[[], None]) -> bool:
    """Schedule the client's requests on `loop` through `send`; `closed()` is called once its last
    unit ends. Returns False for a client with nothing to send (then `closed` is never called)."""
    pending = deque(
        sorted(client.units, key=lambda u: u[0].arrival_s or 0.0) if client.concurrency is None else client.units
    )
    in_flight = [0]
    if not pending:
        return False

    def launch() -> None:
        unit = pending.popleft()
        in_flight[0] += 1
        run(unit, 0)
        if client.concurrency is None and pending:  # chained: only one unit is scheduled at a time
            nxt = pending[0][0]
            loop.at(client.start_s + (nxt.arrival_s or 0.0), launch)

    def unit_done() -> None:
        in_flight[0] -= 1
        if pending and client.concurrency is not None:
            launch()
        elif not pending and in_flight[0] == 0:
            closed()

    def run(unit: tuple[SimRequest, ...], i: int) -> None:
        req = unit[i]

        def done() -> None:
            if i + 1 < len(unit):
                loop.after(client.think_s, run, unit, i + 1)
            else:
                unit_done()

        t = client.start_s + req.arrival_s if (req.arrival_s is not None and i == 0) else loop.now
        loop.at(t, send, client.name, req, done)

    if client.concurrency is None:
        loop.at(client.start_s + (pending[0][0].arrival_s or 0.0), launch)
    else:
        for _ in range(min(client.concurrency, len(pending))):
            launch()
    return True
