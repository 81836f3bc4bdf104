"""Admission control: a FIFO gate per pool with a bounded waiting queue, and request deadlines.

Every request holds a **decode slot** from admission to its last token (its decode worker reserves
KV blocks for it first and keeps them to the end), and a **prefill slot** from admission to its
first token (wherever the prefill runs). A gate lets `capacity` requests through at once; the next
`max_waiting` wait in arrival order; anything beyond gets HTTP 429 with Retry-After at once, before
any tokenization. Requests wait here, not inside a worker, so a deadline or a client that leaves
costs nothing in the pools, and routing sees each request's prompt when it really starts.

Under `--scheduling-policy priority` the waiting requests are let through in priority order (lower
first; within a priority, the tenant holding the fewest slots for its `--tenant-weights` weight,
then the one let through least often for its weight, so tenants take turns; then the earlier TTFT
target, then arrival), and a request that finds the queue full takes
the place of a waiting one it outranks (that one gets the 429): overload refuses the lowest priority
present and, within it, the tenant furthest over its share. The refusal then happens after the body
is read (its priority is in it), not in the middleware.

A request's **deadline** is its arrival plus `request_timeout` (shortened by the
x-stainless-read-timeout header that OpenAI SDKs send): waiting past it is a 503 with Retry-After
(the server is saturated), running past it a 504, in-band as an SSE error event once streaming;
the caller aborts the request in the backend, which frees its blocks in both pools.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import overload

from common.request import DEFAULT_TENANT
from common.roles import Role
from common.tenants import parse_tenant_weights
from router.config import ServerConfig
from router.errors import RETRY_AFTER_S
from router.protocol import APIError

__all__ = [
    "AdmissionControl",
    "Deadline",
    "Gate",
    "LoadShedding",
    "Ticket",
    "deadline_error",
    "request_deadline",
    "share_of",
]

CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"  # sent by the OpenAI Python and Node SDKs


@dataclass(frozen=True)
class Deadline:
    """When a request must be done: `at` on the time.monotonic() clock, `seconds` after its arrival."""

    at: float
    seconds: float

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())


@overload
def share_of(total: int, routers: int, index: int) -> int: ...
@overload
def share_of(total: None, routers: int, index: int) -> None: ...
@overload
def share_of(total: int | None, routers: int, index: int) -> int | None: ...
def share_of(total: int | None, routers: int, index: int) -> int | None:
    """Router `index`'s share of a deployment-wide limit split among `routers` router processes:
    the shares add up to `total` (the first `total % routers` get one more), and each is at least
    1 so that every router can serve (None: no limit)."""
    if routers < 1 or not 0 <= index < routers:
        raise ValueError(f"router index {index} out of range for {routers} routers")
    if total is None:
        return None
    return max(1, total // routers + (1 if index < total % routers else 0))


def request_deadline(config: ServerConfig, headers, arrival: float) -> Deadline | None:
    """The request's deadline from `arrival` (monotonic), or None for none."""
    timeouts = [config.request_timeout] if config.request_timeout is not None else []
    sent = headers.get(CLIENT_TIMEOUT_HEADER)
    if sent is not None:
        try:
            client = float(sent)
        except ValueError:
            client = math.nan  # an SDK header, not request input: garbage is ignored, not refused
        if math.isfinite(client) and client > 0:
            timeouts.append(client)
    return Deadline(arrival + min(timeouts), min(timeouts)) if timeouts else None


def deadline_error(timeout_s: float, running: bool) -> APIError:
    if running:
        return APIError(
            f"the request ran past its deadline of {timeout_s:.1f} s (request_timeout, or the client's "
            f"timeout) and was stopped",
            504,
            None,
            "TimeoutError",
        )
    return APIError(
        f"the request waited for a free slot until its deadline ({timeout_s:.1f} s after arrival): the "
        f"server is saturated",
        503,
        None,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


@dataclass
class GateState:
    capacity: int | None
    running: int
    waiting: int
    max_waiting: int


@dataclass
class _Waiter:
    key: tuple[int, float, int]  # (priority, TTFT target, arrival number); fcfs orders by arrival alone
    granted: asyncio.Future
    tenant: str = DEFAULT_TENANT


class Gate:
    """`capacity` requests at once (None: no limit), then at most `max_waiting` waiting, let through
    in arrival order or (`by_priority`) in priority order."""

    def __init__(
        self,
        pool: str,
        capacity: int | None,
        max_waiting: int,
        by_priority: bool = False,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        self.pool = pool
        self.max_waiting = max_waiting
        self.by_priority = by_priority
        self.weights = dict(tenant_weights or {})
        self.vtime: dict[str, float] = {}  # per tenant: requests admitted / its weight
        self.holding: dict[str, int] = {}  # per tenant: slots held now
        self.running = 0
        self._waiters: list[_Waiter] = []
        self._arrivals = 0
        self._capacity = capacity

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @capacity.setter
    def capacity(self, capacity: int | None) -> None:
        """Resize (the pool grew or shrank): new room goes to the waiting requests at once; when it
        shrank, running requests finish and no new one starts until it is back under capacity."""
        self._capacity = capacity
        self._admit_waiters()

    def state(self) -> GateState:
        return GateState(self.capacity, self.running, len(self._waiters), self.max_waiting)

    def _free(self) -> bool:
        return self.capacity is None or self.running < self.capacity

    def full(self) -> bool:
        """True when a new request could neither run nor wait."""
        return not (self._free() and not self._waiters) and len(self._waiters) >= self.max_waiting

    def overloaded(self) -> APIError:
        return APIError(
            f"the {self.pool} pool is saturated: {self.running} requests running and {len(self._waiters)} waiting "
            f"(max_waiting_{'requests' if self.pool == Role.DECODE else 'prefills'}={self.max_waiting}); retry later",
            429,
            None,
            "RateLimitError",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def acquire(
        self,
        deadline: Deadline | None,
        priority: int = 0,
        ttft_target: float | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> float:
        """Take a slot, waiting in line until `deadline`; returns the seconds waited."""
        self._arrived(tenant)
        if self._free() and not self._waiters:
            self._grant(tenant)
            return 0.0
        self._arrivals += 1
        key = (priority, math.inf if ttft_target is None else ttft_target, self._arrivals)
        waiter = _Waiter(key, asyncio.get_running_loop().create_future(), tenant)
        if len(self._waiters) >= self.max_waiting:
            # Under fcfs this request is refused. Under the priority policy the refused one is the
            # lowest priority present and, within it, of the tenant furthest over its share: this
            # one, or a waiting one it outranks.
            worst = max(self._waiters, key=self._refusal_order, default=None)
            if worst is None or not self.by_priority or self._refusal_order(worst) <= self._refusal_order(waiter):
                raise self.overloaded()
            self._waiters.remove(worst)
            worst.granted.set_exception(self.overloaded())
        started = time.monotonic()
        granted = waiter.granted
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(None if deadline is None else deadline.remaining()):
                await granted
        except BaseException as e:
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.release(tenant)  # the slot came just as we gave up: pass it on
            else:
                granted.cancel()
                self._waiters = [w for w in self._waiters if w.granted is not granted]
            if isinstance(e, TimeoutError):
                raise deadline_error(deadline.seconds if deadline else 0.0, running=False) from None
            raise
        return time.monotonic() - started

    def release(self, tenant: str = DEFAULT_TENANT) -> None:
        self.running -= 1
        self.holding[tenant] = max(0, self.holding.get(tenant, 0) - 1)
        self._admit_waiters()

    def _order(self, w: _Waiter) -> tuple[int, float, float, float, int]:
        if not self.by_priority:
            return (0, 0.0, 0.0, 0.0, w.key[2])
        weight = self.weights.get(w.tenant, 1.0)
        return (w.key[0], self.holding.get(w.tenant, 0) / weight, self.vtime.get(w.tenant, 0.0), w.key[1], w.key[2])

    def _refusal_order(self, w: _Waiter) -> tuple[int, float, float, int]:
        """The larger, the sooner refused under overload: priority, then the tenant's share held and
        let through (for its weight), then the latest arrival."""
        weight = self.weights.get(w.tenant, 1.0)
        return (w.key[0], self.holding.get(w.tenant, 0) / weight, self.vtime.get(w.tenant, 0.0), w.key[2])

    def _arrived(self, tenant: str) -> None:
        """A tenant with no request waiting starts at the waiting tenants' earliest virtual time."""
        waiting = {w.tenant for w in self._waiters}
        if not self.by_priority or tenant in waiting:
            return
        times = [self.vtime.get(t, 0.0) for t in waiting]
        self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), min(times) if times else 0.0)

    def _grant(self, tenant: str) -> None:
        self.running += 1
        self.holding[tenant] = self.holding.get(tenant, 0) + 1
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + 1.0 / self.weights.get(tenant, 1.0)

    def _admit_waiters(self) -> None:
        # Free slots go to the waiting requests in order (one that gave up is skipped).
        while self._waiters and self._free():
            waiter = min(self._waiters, key=self._order)
            self._waiters.remove(waiter)
            if not waiter.granted.done():
                self._grant(waiter.tenant)
                waiter.granted.set_result(None)


class Ticket:
    """One admitted request's slots; each release is idempotent."""

    def __init__(self, admission: AdmissionControl, waited_s: float, tenant: str = DEFAULT_TENANT) -> None:
        self._admission = admission
        self.waited_s = waited_s
        self.tenant = tenant
        self._prefill = True
        self._decode = True

    def first_token(self) -> None:
        if self._prefill:
            self._prefill = False
            self._admission.prefill.release(self.tenant)

    def release(self) -> None:
        self.first_token()
        if self._decode:
            self._decode = False
            self._admission.decode.release(self.tenant)


class AdmissionControl:
    """The decode and prefill gates, and counts of what they refused."""

    def __init__(self, config: ServerConfig) -> None:
        self.by_priority = config.scheduling_policy == "priority"
        weights = parse_tenant_weights(config.tenant_weights)
        self.decode = Gate(
            Role.DECODE, config.max_running_requests, config.max_waiting_requests, self.by_priority, weights
        )
        self.prefill = Gate(
            Role.PREFILL, config.max_running_prefills, config.max_waiting_prefills, self.by_priority, weights
        )
        self.rejected: Counter[str] = Counter()  # by reason

    def check(self) -> None:
        """Refuse at once (429) when the request could not even wait; cheap, before reading the body.
        Under the priority policy the gates decide once the request's priority is known."""
        if self.by_priority:
            return
        for gate in (self.decode, self.prefill):
            if gate.full():
                self.rejected[f"{gate.pool}_queue_full"] += 1
                raise gate.overloaded()

    async def admit(
        self,
        deadline: Deadline | None,
        priority: int = 0,
        ttft_target: float | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> Ticket:
        """Wait for a decode slot, then a prefill slot (always in that order, so nothing deadlocks)."""
        waited = 0.0
        for gate in (self.decode, self.prefill):
            try:
                waited += await gate.acquire(deadline, priority, ttft_target, tenant)
            except APIError as e:
                self.rejected[f"{gate.pool}_queue_full" if e.status == 429 else "deadline_waiting"] += 1
                if gate is self.prefill:
                    self.decode.release(tenant)
                raise
            except BaseException:
                if gate is self.prefill:
                    self.decode.release(tenant)
                raise
        return Ticket(self, waited, tenant)

    def state(self) -> dict:
        return {
            "decode": vars(self.decode.state()),
            "prefill": vars(self.prefill.state()),
            "rejected": dict(self.rejected),
        }


class LoadShedding:
    """ASGI middleware: a generation request that could not even wait gets its 429 here, before
    routing, body reading or anything else (the handlers check again, for requests that raced)."""

    def __init__(self, app, admission: AdmissionControl, paths: frozenset[str]) -> None:
        self.app = app
        self.admission = admission
        self.paths = paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            try:
                self.admission.check()
            except APIError as e:
                body = json.dumps(e.body()).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
                await send({"type": "http.response.start", "status": e.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
