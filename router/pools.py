"""The worker pools as the router sees them: membership, health, output pumps, draining.

`WorkerPools` knows workers; the requests on them are `requests` (a `router.requests.RequestTable`,
which `router.ray_backend.RayBackend` runs over it), to which the pools hand what workers say.
Every call to a worker goes through its typed client (`common.worker_client.WorkerClient`).

- **Health**: the health loop's one `heartbeat` RPC per worker and interval returns the worker's
  stats and its KV events since the last one; they feed `prefix_index` (a `PrefixIndex`), which
  the KV-aware routing policy reads. A worker that stops answering, dies, or restarts (new pid)
  has its index entries dropped at once, so nothing is routed to it for its cache. A dead worker
  is marked down (requests on it are told: `WorkerLost`); Ray restarts it (restartable actors)
  and the first heartbeat it answers re-admits it. One that Ray will not restart any more
  (ActorDiedError, or Ray's state DEAD: an actor the memory monitor killed answers every call with
  OutOfMemoryError, restarts left or not) is `gone`: the callbacks given to `subscribe_gone` (the
  pool manager's) hear of it, and replace it.
- **Outputs**: one long-poll loop ("pump") per worker carries everything its outbox holds for this
  router at once (decoded tokens, prefills' outcomes) to each request's inbox; each request's flow
  drops what comes from a worker it has left.
- **Leases**: every call names this router (`router`, a `RouterClaim`): with several router
  processes over the same workers (`baton serve --api-server-count N`) each worker keeps one
  outbox and one KV-event queue per router, and ends the requests of a router whose lease (renewed
  by its long-polls, heartbeats and a renewal every quarter of the term) runs out.
- **Membership**: `add_worker`, `drain_worker` and `remove_worker` change the pools at runtime
  (cluster.pool_manager creates and stops the actors). A draining worker gets no new request;
  what it runs finishes or, after the drain timeout, moves to other workers.

Imports ray but never torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError, RayTaskError

from common.lora import LoRAStatus
from common.protocol import (
    DEFAULT_ROUTER_ID,
    GrammarCounts,
    KVEndpoint,
    RequestOutput,
    RouterClaim,
    RouterLeaseInfo,
    SpecDecodeStats,
    WorkerStats,
)
from common.request import RequestContext
from common.roles import Role
from common.worker_client import WorkerClient
from router.backend import BackendError, WorkerInfo
from router.migration import pick_worker
from router.prefix_index import PrefixIndex
from router.requests import RequestTable
from router.routing import able_workers

T = TypeVar("T")

__all__ = ["DEFAULT_LEASE_S", "PoolWorker", "WorkerEntry", "WorkerPools"]

log = logging.getLogger("baton.router")

DEFAULT_LEASE_S = 5.0  # a router silent this long is gone for the workers (cluster.config: router_lease)


class WorkerEntry(Protocol):
    """A started worker as the pools take it (cluster.placement.SpawnedWorker is one)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def role(self) -> Role: ...
    @property
    def handle(self) -> object: ...


@dataclass
class PoolWorker:
    """The pools' live state of one worker (never leaves this module's users: they get WorkerInfo)."""

    worker_id: str
    role: Role
    handle: object  # the actor's handle (Ray's state of the actor is asked by it)
    client: WorkerClient
    alive: bool = True
    draining: bool = False
    gone: bool = False  # dead for good (no restart left): only a replacement brings the pool back
    stats: WorkerStats | None = None
    endpoint: KVEndpoint | None = None  # a decode worker's, fetched once per incarnation
    last_seen: float = field(default_factory=time.monotonic)
    last_heartbeat: float | None = None  # wall clock of the last answer
    down: asyncio.Event | None = None  # set when marked down: calls waiting on it stop waiting (see unless_down)
    routers: tuple[RouterLeaseInfo, ...] = ()  # the routers holding a lease on it, as of its last heartbeat


class WorkerPools:
    def __init__(
        self,
        workers: Sequence[WorkerEntry],
        health_interval_s: float = 2.0,
        health_timeout_s: float = 10.0,
        poll_timeout_s: float = 0.5,
        prefix_index: PrefixIndex | None = None,
        router: RouterClaim | None = None,
    ) -> None:
        self._workers: dict[str, PoolWorker] = {}
        self.router = router or RouterClaim(DEFAULT_ROUTER_ID, DEFAULT_LEASE_S)
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        # A decode worker answers its long-poll as soon as it has outputs, so the timeout only paces
        # the polls of an idle worker. An idle default deployment's processes (router, workers,
        # Ray's) took 6.5% of a core with polls every 0.05 s, 2.5% at 0.5 s (per-thread CPU time
        # over 20 s): CPU a neighbour, or another server on the host, can use.
        self.poll_timeout_s = poll_timeout_s
        self.requests = RequestTable()
        self.prefix_index = prefix_index if prefix_index is not None else PrefixIndex()
        self._queued_prefill: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._pumps: dict[str, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called from the health loop while some worker is gone for good (the pool manager's hook).
        self._on_gone: list[Callable[[], None]] = []
        # Ray's state of a worker's actor (ALIVE, RESTARTING, DEAD, ...; blocking, so called in a
        # thread), asked of down workers (_find_dead). The pool manager sets it; without it only an
        # ActorDiedError marks a worker gone.
        self.actor_state: Callable[[object], str | None] | None = None
        # Seconds from a worker queueing an output to the router receiving it (bounded sample).
        self.stream_delays: deque[float] = deque(maxlen=10000)
        for w in workers:
            self.add_worker(w.worker_id, w.role, w.handle)

    def subscribe_gone(self, callback: Callable[[], None]) -> None:
        """Call `callback` from the health loop while some worker is gone for good."""
        self._on_gone.append(callback)

    def ensure_started(self) -> None:
        """Start the health loop and the output pumps on the running event loop (idempotent).
        Raises RuntimeError when there is no running loop, or when they run on another loop that
        is still running: a second pump per worker would split its outputs between two long-polls
        and could hand a stream its tokens out of order."""
        loop = asyncio.get_running_loop()
        if self._tasks and self._loop is loop:
            return
        if self._tasks and self._loop is not None and self._loop.is_running():
            raise RuntimeError("these worker pools are served from another event loop")
        # First use, or a new event loop (a second router app over the same workers, after the
        # first one's server stopped): the old loop's tasks are gone with it; start them here.
        self._loop = loop
        self._tasks = [loop.create_task(self._health_loop()), loop.create_task(self._lease_loop())]
        self._pumps = {}
        for w in self._workers.values():
            w.down = None  # an Event belongs to the loop it was used in
            self._start_pump(w)

    def _start_pump(self, w: PoolWorker) -> None:
        if self._loop is not None and w.worker_id not in self._pumps:
            self._pumps[w.worker_id] = self._loop.create_task(self._pump(w))

    async def close(self) -> None:
        for task in [*self._tasks, *self._pumps.values()]:
            task.cancel()
        self._tasks, self._pumps = [], {}

    # ---- the pools -----------------------------------------------------------------------------
    def add_worker(self, worker_id: str, role: Role, handle: object) -> None:
        """Serve with one more worker (already started and ready); new requests may go to it at once."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already in the pools")
        try:
            role = Role(role)
        except ValueError:
            raise ValueError(f"role must be prefill or decode, got {role!r}") from None
        w = PoolWorker(worker_id, role, handle, WorkerClient(handle))
        self._workers[worker_id] = w
        self._queued_prefill[worker_id] = 0
        self._start_pump(w)

    def in_flight(self, worker_id: str) -> int:
        """Requests the router has on this worker now (decoding there, or prefilling there)."""
        return len(self.requests.on_worker(worker_id))

    async def drain_worker(self, worker_id: str, timeout_s: float) -> int:
        """Stop routing to the worker and wait, up to timeout_s, for its requests to finish; then
        move a decode worker's remaining requests to other decode workers (a prefill worker's
        remaining prefills fail over when it stops). Returns the requests moved."""
        w = self._get(worker_id)
        w.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight(worker_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        moved = 0
        if w.role is Role.DECODE:
            moved = self.requests.worker_lost(worker_id, f"decode worker {worker_id} is being removed", failure=False)
            # The moves themselves are quick (a resubmit each); bounded anyway.
            deadline = time.monotonic() + max(5.0, self.health_timeout_s)
            while self.in_flight(worker_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        return moved

    def remove_worker(self, worker_id: str) -> object:
        """Forget the worker (its prefix-index entries go with it, its requests move); returns its
        actor handle to stop."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            raise ValueError(f"unknown worker {worker_id!r}")
        pump = self._pumps.pop(worker_id, None)
        if pump is not None:
            pump.cancel()
        self.prefix_index.remove_worker(worker_id)
        self._queued_prefill.pop(worker_id, None)
        self.requests.worker_lost(worker_id, f"{w.role} worker {worker_id} was removed")
        return w.handle

    def router_leases(self) -> list[dict]:
        """The routers holding leases on the workers, as their last heartbeats said: per router,
        the workers it holds a lease on, its requests there and its longest silence."""
        seen: dict[str, dict] = {}
        for w in list(self._workers.values()):
            for lease in w.routers:
                entry = seen.setdefault(
                    lease.router_id,
                    {
                        "router_id": lease.router_id,
                        "workers": [],
                        "requests": 0,
                        "idle_s": 0.0,
                        "lease_s": lease.lease_s if lease.lease_s < float("inf") else None,
                    },
                )
                entry["workers"].append(w.worker_id)
                entry["requests"] += lease.requests
                entry["idle_s"] = max(entry["idle_s"], lease.idle_s)
        return sorted(seen.values(), key=lambda e: e["router_id"])

    async def on_every_worker(self, call: Callable[[WorkerClient], Awaitable[T]]) -> list[T]:
        """`call` on every live worker's client at once; the first failure is raised (a Ray task's
        error as the exception the worker raised)."""
        try:
            return list(await asyncio.gather(*(call(w.client) for w in list(self._workers.values()) if w.alive)))
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise cause if isinstance(cause, Exception) else exc from None

    def gone_workers(self) -> list[str]:
        """Workers dead for good (restarts used up): the pool manager replaces them."""
        return [w.worker_id for w in self._workers.values() if w.gone]

    def workers(self) -> list[WorkerInfo]:
        try:
            self.ensure_started()
        except RuntimeError:
            pass  # no running loop (sync code), or another loop's (a caller in another thread): report what we know
        in_flight = self.requests.in_flight_counts()
        queued = self._queued_prefill
        infos = []
        for w in list(self._workers.values()):
            s = w.stats
            infos.append(
                WorkerInfo(
                    worker_id=w.worker_id,
                    role=w.role,
                    alive=w.alive,
                    running=s.num_running if s else 0,
                    waiting=s.num_waiting if s else 0,
                    kv_usage=s.kv_usage if s else 0.0,
                    queued_prefill_tokens=queued.get(w.worker_id, 0),
                    prefix_cache_queries=s.prefix_cache_queries if s else 0,
                    prefix_cache_hits=s.prefix_cache_hits if s else 0,
                    last_heartbeat=w.last_heartbeat,
                    draining=w.draining,
                    pid=s.pid if s else None,
                    in_flight=in_flight.get(w.worker_id, 0),
                    kv_transfer_failures=dict(s.kv_transfer_failures) if s else {},
                    grammar=s.grammar if s else GrammarCounts(),
                    spec_decode=s.spec_decode if s else SpecDecodeStats(),
                    tp_size=s.tp_size if s else 1,
                    rank_pids=s.rank_pids if s else (),
                    lora=s.lora if s else LoRAStatus(),
                )
            )
        return infos

    # ---- health --------------------------------------------------------------------------------
    async def refresh_stats(self) -> None:
        """Ask every worker for its stats and KV events now; a worker that does not answer is marked dead."""

        async def one(w: PoolWorker) -> None:
            try:
                beat = await asyncio.wait_for(w.client.heartbeat(self.router), self.health_timeout_s)
            except (RayError, asyncio.TimeoutError) as exc:
                self.mark_down(w, exc)
                return
            if self._workers.get(w.worker_id) is not w:
                return  # removed while we asked
            old = w.stats
            if not w.alive:
                w.down = None  # back: calls to it may wait for answers again
            if old is not None and (old.pid != beat.stats.pid or not w.alive):
                # Restarted (or back from the dead): what we knew of its cache is gone, and so is
                # its KV endpoint (a new process allocated a new cache).
                self.prefix_index.remove_worker(w.worker_id)
                w.endpoint = None
                log.warning("worker %s (%s) is back (pid %s)", w.worker_id, w.role, beat.stats.pid)
            w.stats, w.routers = beat.stats, beat.routers
            w.alive, w.gone, w.last_seen, w.last_heartbeat = True, False, time.monotonic(), time.time()
            batch = beat.kv_events
            if batch.snapshot is not None:
                self.prefix_index.replace(w.worker_id, batch.snapshot)
            else:
                self.prefix_index.apply(w.worker_id, batch.events)

        await asyncio.gather(*(one(w) for w in list(self._workers.values())))

    def mark_down(self, w: PoolWorker, exc: object) -> None:
        """The worker failed a call or a heartbeat: route around it and tell its requests."""
        if w.alive:
            log.warning("worker %s (%s) is down: %s", w.worker_id, w.role, exc)
        w.alive = False
        if w.down is not None:
            w.down.set()
        # ActorDiedError: no restart left (ActorUnavailableError, its sibling, means restarting).
        # Not when a call failed because another actor died (a tensor-parallel rank): Ray raises
        # that as a RayTaskError that is also an ActorDiedError, and the worker itself restarts.
        w.gone = w.gone or (isinstance(exc, ActorDiedError) and not isinstance(exc, RayTaskError))
        self.prefix_index.remove_worker(w.worker_id)
        self.requests.worker_lost(w.worker_id, f"{w.role} worker {w.worker_id} is down")

    async def _find_dead(self) -> None:
        """Mark gone the down workers whose actors Ray has given up on. A call to such an actor
        raises ActorDiedError, except when the memory monitor killed it: then every call raises
        OutOfMemoryError, which does not say whether a restart is coming, so ask Ray."""
        if self.actor_state is None:
            return
        for w in [w for w in self._workers.values() if not w.alive and not w.gone]:
            try:
                state = await asyncio.to_thread(self.actor_state, w.handle)
            except Exception:  # only a hint: Ray shutting down, its GCS unreachable, a handle of no Ray actor
                continue
            if state == "DEAD" and not w.alive:
                w.gone = True
                log.warning("worker %s (%s) is dead for good: Ray will not restart it", w.worker_id, w.role)

    async def _health_loop(self) -> None:
        while True:
            await self.refresh_stats()
            await self._find_dead()
            if self._on_gone and self.gone_workers():
                for callback in self._on_gone:
                    callback()
            await asyncio.sleep(self.health_interval_s)

    async def _lease_loop(self) -> None:
        """Renew this router's lease on every live worker four times per term: a worker's lease
        must outlast a heartbeat delayed by a slow worker, and prefill workers have no long-poll."""

        async def renew(w: PoolWorker) -> None:
            try:
                await asyncio.wait_for(w.client.renew_lease(self.router), self.router.lease_s)
            except (RayError, asyncio.TimeoutError):
                pass  # the health loop decides about the worker

        while True:
            await asyncio.gather(*(renew(w) for w in list(self._workers.values()) if w.alive))
            await asyncio.sleep(self.router.lease_s / 4)

    async def _pump(self, w: PoolWorker) -> None:
        while True:
            if not w.alive:
                await asyncio.sleep(self.health_interval_s)
                continue
            try:
                outputs = await w.client.poll_outputs(self.poll_timeout_s, self.router)
            except RayError as exc:
                self.mark_down(w, exc)
                continue
            now = time.time()
            for out in outputs:
                if isinstance(out, RequestOutput):  # a prefill's outcome is queued after its KV handoff
                    self.stream_delays.append(now - out.created_at)
                self.requests.deliver(w.worker_id, out)

    async def unless_down(self, w: PoolWorker, call):
        """Await a call to the worker, but no longer than the worker is considered alive: a call to
        an actor Ray is restarting (or cannot place again) would wait until it is back, for ever if
        it never is. Raises ActorUnavailableError once the worker is marked down."""
        if w.down is None:
            w.down = asyncio.Event()
        if not w.alive or w.down.is_set():
            if asyncio.iscoroutine(call):
                call.close()
            raise ActorUnavailableError(f"worker {w.worker_id} is down", None)
        task = asyncio.ensure_future(call)
        watch = asyncio.ensure_future(w.down.wait())
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()  # marked down, or our caller was cancelled: stop waiting for the answer
        if task.done() and not task.cancelled():
            return task.result()
        raise ActorUnavailableError(f"worker {w.worker_id} went down (no answer to its heartbeat)", None)

    def get(self, worker_id: str | None) -> PoolWorker | None:
        return self._workers.get(worker_id) if worker_id is not None else None

    def _get(self, worker_id: str) -> PoolWorker:
        w = self._workers.get(worker_id)
        if w is None:
            raise BackendError(f"unknown worker {worker_id!r}")
        return w

    # ---- what a request asks of the pools (router.flow.WorkerPicker and the backend's calls) -----
    def usable(self, worker_id: str | None) -> bool:
        w = self.get(worker_id)
        return w is not None and w.alive and not w.draining

    def pick(
        self, role: Role, exclude: frozenset[str] = frozenset(), context: RequestContext | None = None
    ) -> str | None:
        able = able_workers([info for info in self.workers() if info.role is role], context)
        return pick_worker(able, exclude)

    async def endpoint(self, w: PoolWorker) -> KVEndpoint:
        """A decode worker's KV endpoint, fetched once per incarnation."""
        if w.endpoint is None:
            w.endpoint = await w.client.endpoint()
        return w.endpoint

    def queue_tokens(self, worker_id: str, delta: int) -> None:
        """Prompt tokens counted as queued prefill work on the worker (the routing policy's queue term)."""
        if worker_id in self._queued_prefill:
            self._queued_prefill[worker_id] = max(0, self._queued_prefill[worker_id] + delta)
