"""The cluster simulator: a Baton deployment as a discrete-event simulation.

Each request is driven by the router's own `router.flow.RequestFlow`, whose commands run as calls to
simulated workers (cluster.sim.executor) with the same records and the same worker interface as a
real deployment (`common.worker_api.WorkerAPI`), under the router's real routing policy
(`router.routing.make_policy`: `KvAwarePolicy` by default) and real `router.prefix_index.PrefixIndex`,
fed by the simulated workers' heartbeats (stats and KV events) as the router's health loop feeds it.
What is the simulator's own is how long things take (cluster.sim.engine, cluster.sim.costs).
With LoRA on (`EngineSettings.max_loras`), each heartbeat's stats carry the workers' `LoRAStatus`
into the `WorkerInfo`s the policy ranks, as the router's pools do (cluster.sim.lora).

Pools change while it runs, as in production: `add_worker`, `drain_worker` (no new requests; what
the worker runs finishes, or after `drain_timeout_s` moves to other decode workers, as the pool
manager's drain does), `kill_worker` (its requests migrate, or a prefill fails over; optionally it
restarts empty), and `end_request` (a client that goes away, a deadline).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.sim.clients import start_client
from cluster.sim.costs import CostModel, LinkModel, ServingOverheads
from cluster.sim.engine import EngineSettings, SimWorker
from cluster.sim.events import EventLoop
from cluster.sim.executor import Flight, FlowExecutor, worker_request
from cluster.sim.host import HostContention, SharedHost
from cluster.sim.metrics import ItlSample, LoRAStats, PoolStats, RequestRecord, SimResult
from cluster.sim.workload import SimRequest, Workload
from common.lora import LoRAStatus
from common.request import RequestContext
from common.roles import ROLES, Role
from router.backend import WorkerInfo
from router.flow import FlowLimits
from router.flow_commands import COUNTERS, EndReason
from router.migration import pick_worker
from router.prefix_index import PrefixIndex
from router.routing import NoWorkerAvailable, RoutingConfig, able_workers, make_policy

__all__ = ["ClusterSpec", "Simulator", "simulate"]


@dataclass(frozen=True)
class ClusterSpec:
    """What is simulated: pool sizes, engine and routing settings (LoRA's among the engine's:
    `EngineSettings.max_loras`, `max_cpu_loras` and the load costs; off by default)."""

    prefill_workers: int = 1
    decode_workers: int = 1
    engine: EngineSettings = field(default_factory=EngineSettings)
    routing: RoutingConfig = field(default_factory=lambda: RoutingConfig(seed=0))
    # After the last arrival, at most this long to finish (an overloaded split would run forever).
    drain_limit_s: float = 120.0
    # A drained worker's requests move to other decode workers after this long (cluster.config's default).
    drain_timeout_s: float = 60.0
    limits: FlowLimits = field(default_factory=FlowLimits)  # migrations (cluster.config's defaults)

    def __post_init__(self) -> None:
        if self.prefill_workers < 0 or self.decode_workers < 1:
            raise ValueError(
                f"need prefill_workers >= 0 and decode_workers >= 1, got {self.prefill_workers}, {self.decode_workers}"
            )
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


class Simulator:
    def __init__(
        self,
        spec: ClusterSpec,
        cost: CostModel,
        overheads: ServingOverheads | None = None,
        link: LinkModel | None = None,
        prefill_cost: CostModel | None = None,
        record_itl: bool = True,
        host: HostContention | None = None,
    ) -> None:
        """`host`: every worker runs on one CPU host, their steps slowing each other's as it says
        (cluster.sim.host); None: each worker has its machine to itself."""
        self.spec = spec
        self.cost = cost
        self.prefill_cost = prefill_cost or cost
        self.overheads = overheads or ServingOverheads()
        self.link = link or LinkModel("default", 50e9)
        self.loop = EventLoop()
        self.host = None if host is None else SharedHost(self.loop, host)
        self.index = PrefixIndex()
        self.policy = make_policy(spec.routing, self.index, spec.engine.block_size)
        self.workers: dict[str, SimWorker] = {}
        self._born: dict[str, float] = {}
        self._state: dict[str, str] = {}  # starting | up | draining | removed | dead
        self._stats: dict[str, tuple[int, int, float]] = {}  # (running, waiting, KV usage) at the last heartbeat
        self._lora: dict[str, LoRAStatus] = {}  # each worker's adapters at the last heartbeat
        self._gone: dict[str, float] = {}
        self._next_id = dict.fromkeys(ROLES, 0)
        self._infos: list[WorkerInfo] = []
        self._pos: dict[str, int] = {}
        self._queued: dict[str, int] = {}
        # Workers killed and replaced by a restart under the same id, with their lifetimes (they cost GPUs too).
        self.retired: list[tuple[SimWorker, float, float]] = []
        self.records: list[RequestRecord] = []
        self.executor = FlowExecutor(
            self.loop, self.workers, self.overheads, self, self._set_queued, self._end, spec.limits, record_itl
        )
        self.executor.counters.update(dict.fromkeys(COUNTERS, 0))
        self.decision_s: list[float] = []
        self.timeline: list[dict] = []
        self.recent: deque[RequestRecord] = deque()  # completed in the last window (autoscaler signals)
        self._open_clients = 0
        self._stopped = False
        self.unstarted: dict[str, float] = {}  # routed, not yet computing: request id -> routed at
        self._last_arrival = 0.0
        for _ in range(spec.prefill_workers):
            self.add_worker(Role.PREFILL)
        for _ in range(spec.decode_workers):
            self.add_worker(Role.DECODE)

    @property
    def counters(self) -> dict[str, int]:
        """What the flows counted, as RayBackend.counters."""
        return self.executor.counters

    @property
    def itl(self) -> ItlSample:
        return self.executor.itl

    # ---- pools -------------------------------------------------------------------------------
    def add_worker(self, role: Role, ready_in_s: float = 0.0, worker_id: str | None = None) -> str:
        """A new worker, routable once ready_in_s has passed (its start-up); it costs GPUs from now."""
        role = Role(role)
        if worker_id is None:
            worker_id = f"{role}-{self._next_id[role]}"
            self._next_id[role] += 1
        cost = self.prefill_cost if role is Role.PREFILL else self.cost
        w = SimWorker(self.loop, worker_id, role, cost, self.spec.engine, self.link, self.host)
        w.on_started = self._started
        w.on_outputs = self.executor.outputs_ready
        w.alive = False
        self._state[worker_id] = "starting"
        self._stats[worker_id] = (0, 0, 0.0)
        self._lora[worker_id] = w.lora_status()
        self.workers[worker_id] = w
        self._born[worker_id] = self.loop.now
        self._queued[worker_id] = 0
        self.loop.after(ready_in_s, self._admit, worker_id)
        return worker_id

    def _admit(self, wid: str) -> None:
        if self._state[wid] != "starting":
            return
        self._state[wid] = "up"
        self.workers[wid].alive = True
        self._rebuild_infos()

    def drain_worker(self, role: Role, worker_id: str | None = None) -> str | None:
        """Stop routing to a worker (`worker_id`, or the newest of `role`, a starting one first): what
        it runs finishes, and after the spec's drain_timeout_s a decode worker's requests move to other
        decode workers; it leaves once idle. Never drains the last decode worker. Returns its id, or None."""
        candidates = [
            wid for wid, st in self._state.items() if st in ("starting", "up") and self.workers[wid].role == role
        ]
        if len(candidates) <= (1 if role == Role.DECODE else 0):
            return None
        wid = worker_id if worker_id in candidates else None
        if wid is None:
            if worker_id is not None:
                return None
            wid = max(candidates, key=lambda x: (self._state[x] == "starting", self._born[x], x))
        self._state[wid] = "draining"
        self.workers[wid].alive = False
        self._rebuild_infos()
        self._retire_idle()
        if self.workers[wid].role is Role.DECODE:
            self.loop.after(self.spec.drain_timeout_s, self._drain_timeout, wid)
        return wid

    def _drain_timeout(self, wid: str) -> None:
        if self._state.get(wid) == "draining":
            self.executor.worker_lost(wid, failure=False)  # its requests move (RequestFlow.on_drain)

    def kill_worker(self, worker_id: str, restart_after_s: float | None = None) -> None:
        """The worker dies with everything it held: its decode requests migrate, its prefills fail
        over, as the router's health loop finds out (an RPC later). With `restart_after_s`, Ray
        restarts it empty that much later, under the same id."""
        w = self.workers[worker_id]
        w.kill()
        self._state[worker_id] = "dead"
        self._gone[worker_id] = self.loop.now
        self.index.remove_worker(worker_id)
        self._rebuild_infos()
        self.loop.after(self.overheads.rpc_s, self.executor.worker_lost, worker_id, True)
        if restart_after_s is not None:
            self.loop.after(restart_after_s, self._restart, worker_id)

    def _restart(self, worker_id: str) -> None:
        old = self.workers[worker_id]
        self.retired.append((old, self._born[worker_id], self._gone.pop(worker_id)))
        self.add_worker(old.role, 0.0, worker_id)

    def end_request(self, request_id: str, reason: EndReason = EndReason.CLIENT_GONE) -> None:
        """The client went away (or its deadline passed): the request ends, freeing what it holds."""
        self.executor.end(request_id, reason)

    def _retire_idle(self) -> None:
        for wid, st in self._state.items():
            w = self.workers[wid]
            if st == "draining" and w.idle:
                self._state[wid] = "removed"
                w.removed = True
                self._gone[wid] = self.loop.now
                self.index.remove_worker(wid)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens routed and not prefilled yet, over all workers (as the router counts them)."""
        return sum(self._queued.values())

    def decode_load(self) -> tuple[int, int]:
        """(running, waiting) sequences over the decode pool, as of the last heartbeat."""
        stats = [self._stats[wid] for wid, w in self.workers.items() if w.role == Role.DECODE and not w.removed]
        return sum(s[0] for s in stats), sum(s[1] for s in stats)

    def pool_size(self, role: Role, include_starting: bool = True) -> int:
        states = ("up", "starting") if include_starting else ("up",)
        return sum(1 for wid, st in self._state.items() if st in states and self.workers[wid].role == role)

    # ---- what the router sees ----------------------------------------------------------------
    def _rebuild_infos(self) -> None:
        # A draining worker stays listed as not alive (as a dead one does for the real router).
        infos = []
        in_flight: dict[str, int] = {}
        for f in self.executor.flights.values():
            for wid in f.flow.workers() if f.flow is not None else ():
                in_flight[wid] = in_flight.get(wid, 0) + 1
        for wid, w in self.workers.items():
            if self._state[wid] in ("up", "draining"):
                running, waiting, usage = self._stats[wid]
                infos.append(
                    WorkerInfo(
                        wid,
                        w.role,
                        alive=self._state[wid] == "up",
                        running=running,
                        waiting=waiting,
                        kv_usage=usage,
                        queued_prefill_tokens=self._queued[wid],
                        draining=self._state[wid] == "draining",
                        in_flight=in_flight.get(wid, 0),
                        lora=self._lora[wid],
                    )
                )
        self._infos = infos
        self._pos = {info.worker_id: i for i, info in enumerate(infos)}

    # router.flow.WorkerPicker: where a request goes when the policy is not asked again.
    def usable(self, worker_id: str) -> bool:
        return self._state.get(worker_id) == "up"

    def pick(
        self, role: Role, exclude: frozenset[str] = frozenset(), context: RequestContext | None = None
    ) -> str | None:
        return pick_worker(able_workers([info for info in self._infos if info.role == role], context), exclude)

    def _set_queued(self, wid: str, delta: int) -> None:
        self._queued[wid] = max(0, self._queued.get(wid, 0) + delta)
        i = self._pos.get(wid)
        if i is not None:
            self._infos[i] = dataclasses.replace(self._infos[i], queued_prefill_tokens=self._queued[wid])

    def _heartbeat(self) -> None:
        for wid, w in self.workers.items():
            if w.removed:
                continue
            beat = w.heartbeat()
            s = beat.stats
            self._stats[wid] = (s.num_running, s.num_waiting, s.kv_usage)
            self._lora[wid] = s.lora
            batch = beat.kv_events
            if batch.snapshot is not None:
                self.index.replace(wid, batch.snapshot)
            else:
                self.index.apply(wid, batch.events)
        self._retire_idle()
        self._rebuild_infos()
        live = [(wid, w) for wid, w in self.workers.items() if not w.removed]
        self.timeline.append(
            {
                "t": self.loop.now,
                "prefill_workers": self.pool_size(Role.PREFILL, False),
                "decode_workers": self.pool_size(Role.DECODE, False),
                "queued_prefill_tokens": sum(self._queued.values()),
                "prefill_busy": sum(
                    1 for wid, w in live if w.role == Role.PREFILL and (self._stats[wid][0] or self._stats[wid][1])
                ),
                "decode_waiting": sum(self._stats[wid][1] for wid, w in live if w.role == Role.DECODE),
                "decode_running": sum(self._stats[wid][0] for wid, w in live if w.role == Role.DECODE),
            }
        )
        if not self._finished():
            self.loop.after(self.overheads.heartbeat_s, self._heartbeat)

    # ---- requests ----------------------------------------------------------------------------
    def _send(self, client: str, req: SimRequest, on_done: Callable[[], None]) -> None:
        rec = RequestRecord(req.request_id, client, len(req.prompt), req.output_len, self.loop.now, adapter=req.adapter)
        self.records.append(rec)
        self._last_arrival = max(self._last_arrival, self.loop.now)
        f = Flight(req, worker_request(req), rec, on_done)
        self.loop.after(self.overheads.router_s, self._route, f)

    def _route(self, f: Flight) -> None:
        t0 = time.perf_counter()
        try:
            d = self.policy.choose(list(f.req.prompt), self._infos, f.request.context)
        except NoWorkerAvailable as exc:
            f.rec.failed = str(exc)
            f.on_done()
            return
        finally:
            self.decision_s.append(time.perf_counter() - t0)
        f.rec.route, f.rec.decode_worker, f.rec.prefill_worker = d.reason, d.decode_worker, d.prefill_worker
        self.unstarted[f.req.request_id] = self.loop.now
        self.executor.start(f, d)

    def _started(self, request_id: str, queued_s: float) -> None:
        if self.unstarted.pop(request_id, None) is not None:
            f = self.executor.flights.get(request_id)
            if f is not None:
                f.rec.queue_s = self.loop.now - f.rec.sent_s - self.overheads.router_s

    def _end(self, f: Flight) -> None:
        self.unstarted.pop(f.req.request_id, None)
        if f.rec.completed:
            self.recent.append(f.rec)
        self._retire_idle()
        f.on_done()

    # ---- running it --------------------------------------------------------------------------
    def _client_closed(self) -> None:
        self._open_clients -= 1

    def _finished(self) -> bool:
        return self._stopped or self._open_clients == 0

    def stop(self) -> None:
        """End the run after the event now running (a caller that has seen enough, from an `every`
        ticker: the planner once a probe cannot pass); requests not done by then are failed."""
        self._stopped = True

    def every(self, interval_s: float, fn: Callable[[Simulator], None]) -> None:
        """Call fn(simulator) every interval_s of simulated time while clients are running (the autoscaler)."""

        def tick() -> None:
            fn(self)
            if not self._finished():
                self.loop.after(interval_s, tick)

        self.loop.after(interval_s, tick)

    def run(self, workload: Workload) -> SimResult:
        # What is alive before the run (imported torch and Ray under `baton plan`, the workload) is
        # none of its garbage: out of the collector's full passes, which walked it all (a fifth of
        # a planner's time). Not if someone froze already (the launcher does): theirs stays frozen.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return self._run(workload)
        finally:
            if freeze:
                gc.unfreeze()

    def _run(self, workload: Workload) -> SimResult:
        started = time.perf_counter()
        self._rebuild_infos()
        for client in workload.clients:
            if start_client(self.loop, client, self._send, self._client_closed):
                self._open_clients += 1
        last_open = max((r.arrival_s or 0.0) + c.start_s for c in workload.clients for r in c.requests)
        self._heartbeat()
        self.loop.run(until=last_open + self.spec.drain_limit_s, stop=self._finished)
        for rec in self.records:
            if rec.done_s is None and not rec.failed:
                rec.failed = "not finished when the simulation stopped"
        end = self.loop.now
        lives = [(w, self._born[wid], self._gone.get(wid, end)) for wid, w in self.workers.items()] + self.retired
        pools: dict[str, PoolStats] = {}
        for role in ROLES:
            ws = [w for w, _, _ in lives if w.role == role]
            pools[role] = PoolStats(
                workers=self.pool_size(role, False),
                gpu_seconds=sum((gone - born) * w.cost.gpus_per_worker() for w, born, gone in lives if w.role == role),
                busy_seconds=sum(w.counters.busy_s for w in ws),
                steps=sum(w.counters.steps for w in ws),
                prefill_tokens=sum(w.counters.prefill_tokens for w in ws),
                decode_tokens=sum(w.counters.decode_tokens for w in ws),
                queue_s=[q for w in ws for q in w.counters.queue_s],
            )
        config = {
            "prefill_workers": self.spec.prefill_workers,
            "decode_workers": self.spec.decode_workers,
            "engine": dataclasses.asdict(self.spec.engine),
            "routing": dataclasses.asdict(self.spec.routing),
            "overheads": dataclasses.asdict(self.overheads),
            "link": dataclasses.asdict(self.link),
            "cost_model": _describe(self.cost),
            "prefill_cost_model": _describe(self.prefill_cost),
            "host_contention": None if self.host is None else dataclasses.asdict(self.host.contention),
        }
        return SimResult(
            self.records,
            self.itl,
            pools,
            self.timeline,
            self.decision_s,
            end,
            time.perf_counter() - started,
            config,
            self._lora_stats([w for w, _, _ in lives]),
        )

    def _lora_stats(self, workers: list[SimWorker]) -> LoRAStats | None:
        """The workers' LoRA counters together; None where LoRA played no part."""
        engine = self.spec.engine
        if not engine.max_loras and all(r.adapter is None for r in self.records):
            return None
        out = LoRAStats(engine.max_loras, engine.max_cpu_loras)
        for w in workers:
            if w.lora is None:
                continue
            c = w.lora.counters
            for name, n in c.slot_loads.items():
                out.slot_loads[name] = out.slot_loads.get(name, 0) + n
            for name, n in c.disk_loads.items():
                out.disk_loads[name] = out.disk_loads.get(name, 0) + n
            for k, n in c.steps_by_adapters.items():
                out.steps_by_adapters[k] = out.steps_by_adapters.get(k, 0) + n
            out.load_s += c.load_s
        return out


def _describe(cost: CostModel) -> dict:
    to_dict = getattr(cost, "to_dict", None)
    return to_dict() if to_dict else {"kind": type(cost).__name__}


def simulate(
    workload: Workload,
    spec: ClusterSpec,
    cost: CostModel,
    overheads: ServingOverheads | None = None,
    link: LinkModel | None = None,
    prefill_cost: CostModel | None = None,
    host: HostContention | None = None,
) -> SimResult:
    """Run one workload on one deployment and return its records and pool statistics."""
    return Simulator(spec, cost, overheads, link, prefill_cost, host=host).run(workload)
