"""What a worker keeps per router: who owns each request, one outbox and one KV-event queue per
router, and the lease each router renews.

Several router processes share the workers (`baton serve --api-server-count N`). Each request is
tagged with the router that created it (submit, reserve, prefill carry a `RouterClaim`); its
outputs go to that router's outbox only, and every router collects its own KV events, so each
keeps a complete prefix index. A router renews its lease with every call it makes (its output
long-poll, its heartbeat, a renewal every quarter of the term): a router whose lease runs out is
gone (killed, partitioned, hung), and the worker ends its requests so their KV blocks come back
without waiting for any deadline (`take_expired`; the worker does the aborting on its engine
thread).

Calls made without a claim (tests and tools driving an `EngineWorker` directly) belong to the
default router, whose lease never runs out unless a real router claims it with a term.

Thread-safe: Ray call threads and the engine thread both use it; one lock guards everything.
Imports no torch.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from common.protocol import (
    DEFAULT_ROUTER_ID,
    KVEvent,
    KVEventBatch,
    RequestOutput,
    RouterClaim,
    RouterLeaseInfo,
    WorkerOutput,
)

__all__ = ["RouterLease", "RouterLeases"]


@dataclass
class RouterLease:
    """One router's state on this worker."""

    router_id: str
    term_s: float  # math.inf: never runs out (the default router, until a router claims it)
    renewed_at: float  # on the leases' clock
    outbox: list[WorkerOutput] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)
    kv_event_hashes: int = 0
    # True until the router's first collection when it joined after the worker started (and
    # after an overflow): it gets a snapshot of the whole cache instead of events.
    kv_events_lost: bool = True
    request_ids: set[str] = field(default_factory=set)
    expired_seen_at: float | None = None  # when a check first found it out of term (None: in term)

    def expired(self, now: float) -> bool:
        return now - self.renewed_at > self.term_s


class RouterLeases:
    """The routers a worker serves, their requests, outboxes and KV-event queues."""

    def __init__(
        self, max_kv_event_hashes: int, clock: Callable[[], float] = time.monotonic, confirm_s: float = 0.5
    ) -> None:
        if max_kv_event_hashes < 1:
            raise ValueError(f"max_kv_event_hashes must be >= 1, got {max_kv_event_hashes}")
        self.max_kv_event_hashes = max_kv_event_hashes
        self.confirm_s = confirm_s
        self._clock = clock
        self._ready = threading.Condition()  # guards everything below; notified when an outbox fills
        # The default router has seen every event since the worker started (its cache was empty).
        self._leases: dict[str, RouterLease] = {
            DEFAULT_ROUTER_ID: RouterLease(DEFAULT_ROUTER_ID, math.inf, clock(), kv_events_lost=False)
        }
        self._owner: dict[str, str] = {}  # request id -> router id
        self._attempt: dict[str, int] = {}  # request id -> the router's attempt (stamped on its outputs)

    # ---- leases ----------------------------------------------------------------------------
    def _lease(self, claim: RouterClaim | None) -> RouterLease:
        """The claim's lease, renewed now (created when the router is new here). Lock held."""
        router_id = claim.router_id if claim is not None else DEFAULT_ROUTER_ID
        lease = self._leases.get(router_id)
        if lease is None:
            lease = self._leases[router_id] = RouterLease(router_id, math.inf, self._clock())
        if claim is not None:
            lease.term_s = claim.lease_s
        lease.renewed_at, lease.expired_seen_at = self._clock(), None
        return lease

    def renew(self, claim: RouterClaim | None) -> None:
        with self._ready:
            self._lease(claim)

    def own(self, request_id: str, claim: RouterClaim | None, attempt: int = 0) -> None:
        """The request belongs to the claim's router from now on (its outputs go there, stamped
        with the router's `attempt`)."""
        with self._ready:
            self._attempt[request_id] = attempt
            lease = self._lease(claim)
            previous = self._owner.get(request_id)
            if previous is not None and previous in self._leases:
                self._leases[previous].request_ids.discard(request_id)
            self._owner[request_id] = lease.router_id
            lease.request_ids.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request has ended here (finished, aborted, prefill handed over)."""
        with self._ready:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        router_id = self._owner.pop(request_id, None)
        self._attempt.pop(request_id, None)
        lease = self._leases.get(router_id) if router_id is not None else None
        if lease is not None:
            lease.request_ids.discard(request_id)

    def take_expired(self) -> list[RouterLease]:
        """Remove and return the leases that ran out, as seen by two checks `confirm_s` apart (a
        worker frozen for a while, SIGSTOP or a paused VM, finds every lease out of term when it
        wakes, before the renewals queued meanwhile reach it); their requests are the caller's to end."""
        now = self._clock()
        with self._ready:
            gone = []
            for lease in self._leases.values():
                if not lease.expired(now):
                    continue
                if lease.expired_seen_at is None:
                    lease.expired_seen_at = now
                elif now - lease.expired_seen_at >= self.confirm_s:
                    gone.append(lease)
            for lease in gone:
                del self._leases[lease.router_id]
                for request_id in lease.request_ids:
                    self._owner.pop(request_id, None)
            return gone

    def holders(self) -> tuple[RouterLeaseInfo, ...]:
        """The routers holding a lease here (the default one only while it owns requests or was claimed)."""
        now = self._clock()
        with self._ready:
            return tuple(
                RouterLeaseInfo(lease.router_id, len(lease.request_ids), now - lease.renewed_at, lease.term_s)
                for lease in self._leases.values()
                if lease.router_id != DEFAULT_ROUTER_ID or lease.request_ids or math.isfinite(lease.term_s)
            )

    def owner(self, request_id: str) -> str | None:
        with self._ready:
            return self._owner.get(request_id)

    # ---- outputs ---------------------------------------------------------------------------
    def deliver(self, outputs: Iterable[WorkerOutput]) -> None:
        """Queue each output for the router owning its request (one no router owns any more,
        its router's lease having run out, is dropped). A finished output, or a prefill's outcome,
        ends the request here."""
        with self._ready:
            for out in outputs:
                router_id = self._owner.get(out.request_id)
                lease = self._leases.get(router_id) if router_id is not None else None
                if isinstance(out, RequestOutput):
                    out.attempt = self._attempt.get(out.request_id, 0)
                if not isinstance(out, RequestOutput) or out.finished:
                    self._forget(out.request_id)
                if lease is not None:
                    lease.outbox.append(out)
            self._ready.notify_all()

    def take_outputs(self, claim: RouterClaim | None, timeout_s: float) -> list[WorkerOutput]:
        """The router's queued outputs, waiting up to timeout_s for the first one (renews its lease)."""
        deadline = self._clock() + timeout_s
        with self._ready:
            lease = self._lease(claim)
            while not lease.outbox:
                remaining = deadline - self._clock()
                if remaining <= 0 or self._leases.get(lease.router_id) is not lease:
                    break
                self._ready.wait(remaining)
            outputs, lease.outbox = lease.outbox, []
            return outputs

    # ---- KV events -------------------------------------------------------------------------
    def publish_kv_events(self, events: list[KVEvent]) -> None:
        """Engine thread: the cache's new events, for every router (each queue bounded: past
        `max_kv_event_hashes` it is dropped and that router gets a snapshot instead)."""
        if not events:
            return
        hashes = sum(len(e.block_hashes) or 1 for e in events)
        with self._ready:
            for lease in self._leases.values():
                if lease.kv_events_lost:
                    continue
                lease.kv_events.extend(events)
                lease.kv_event_hashes += hashes
                if lease.kv_event_hashes > self.max_kv_event_hashes:
                    lease.kv_events, lease.kv_event_hashes, lease.kv_events_lost = [], 0, True

    def take_kv_events(
        self, claim: RouterClaim | None, cached_hashes: Callable[[], Iterable[int]], block_size: int
    ) -> KVEventBatch:
        """Engine thread: the router's events since its last collection, or a snapshot of the
        cache (`cached_hashes()`) when it is new here or its queue overflowed."""
        with self._ready:
            lease = self._lease(claim)
            if lease.kv_events_lost:
                batch = KVEventBatch([], tuple(cached_hashes()), block_size)
            else:
                batch = KVEventBatch(lease.kv_events, None, block_size)
            lease.kv_events, lease.kv_event_hashes, lease.kv_events_lost = [], 0, False
            return batch

    def pending_kv_hashes(self, router_id: str = DEFAULT_ROUTER_ID) -> int:
        with self._ready:
            lease = self._leases.get(router_id)
            return 0 if lease is None else lease.kv_event_hashes
