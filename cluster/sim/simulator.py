"""The cluster simulator: a Baton deployment as a discrete-event simulation.

Each request goes through what `router.ray_backend.RayBackend.generate` does, with the router's
real routing policy (`router.routing.make_policy`: `KvAwarePolicy` by default) and real
`router.prefix_index.PrefixIndex`, fed by the simulated workers' KV events at every heartbeat as
the router's health loop feeds it:

- remote prefill: reserve blocks on decode worker D (a call, between D's steps) -> prefill on P
  (`prefill_only`) -> the send begins as P's step ends, the KV moves (`LinkModel`), P's release of
  the blocks is queued (between its steps) -> first token to the client, and start decoding on D
  (between D's steps) -> D streams the rest; no room on D: D prefills locally; a 1-token request:
  P's token is the answer, and D's reservation is aborted beside it;
- local prefill (the policy's choice, or no prefill worker): D runs the whole request.

The router counts each request's prompt as queued prefill work on whoever prefills it until the
first token (the policy's queue term), and sees worker stats (running, waiting, KV usage) as of
the last heartbeat. Pools can grow and shrink while it runs (`add_worker`, `drain_worker`): what
the autoscaler drives.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.sim.costs import CostModel, LinkModel, ServingOverheads
from cluster.sim.engine import EngineSettings, EventLoop, SimWorker
from cluster.sim.metrics import ItlSample, PoolStats, RequestRecord, SimResult
from cluster.sim.workload import Client, SimRequest, Workload
from router.backend import WorkerInfo
from router.prefix_index import PrefixIndex
from router.routing import NoWorkerAvailable, RoutingConfig, make_policy

__all__ = ["ClusterSpec", "Simulator", "simulate"]


@dataclass(frozen=True)
class ClusterSpec:
    """What is simulated: pool sizes, engine and routing settings."""

    prefill_workers: int = 1
    decode_workers: int = 1
    engine: EngineSettings = field(default_factory=EngineSettings)
    routing: RoutingConfig = field(default_factory=lambda: RoutingConfig(seed=0))
    # After the last arrival, at most this long to finish (an overloaded split would run forever).
    drain_limit_s: float = 120.0

    def __post_init__(self) -> None:
        if self.prefill_workers < 0 or self.decode_workers < 1:
            raise ValueError(f"need prefill_workers >= 0 and decode_workers >= 1, got "
                             f"{self.prefill_workers}, {self.decode_workers}")


@dataclass
class _Flight:
    """One request in the router: its record, what to call when it ends, and its queued-prefill entry."""

    req: SimRequest
    rec: RequestRecord
    on_done: Callable[[], None]
    queued_on: str | None = None
    queued: int = 0


class Simulator:
    def __init__(self, spec: ClusterSpec, cost: CostModel, overheads: ServingOverheads | None = None,
                 link: LinkModel | None = None, prefill_cost: CostModel | None = None,
                 record_itl: bool = True) -> None:
        self.spec = spec
        self.cost = cost
        self.prefill_cost = prefill_cost or cost
        self.overheads = overheads or ServingOverheads()
        self.link = link or LinkModel("default", 50e9)
        self.loop = EventLoop()
        self.index = PrefixIndex()
        self.policy = make_policy(spec.routing, self.index, spec.engine.block_size)
        self.workers: dict[str, SimWorker] = {}
        self._born: dict[str, float] = {}
        self._state: dict[str, str] = {}  # starting | up | draining | removed
        self._stats: dict[str, tuple[int, int, float]] = {}  # as of the last heartbeat
        self._gone: dict[str, float] = {}
        self._next_id = {"prefill": 0, "decode": 0}
        self._infos: list[WorkerInfo] = []
        self._pos: dict[str, int] = {}
        self._queued: dict[str, int] = {}
        self.records: list[RequestRecord] = []
        self.itl = ItlSample()
        self.record_itl = record_itl
        self.decision_s: list[float] = []
        self.timeline: list[dict] = []
        self.recent: deque[RequestRecord] = deque()  # completed in the last window (autoscaler signals)
        self._tickers: list[tuple[float, Callable[["Simulator"], None]]] = []
        self._open_clients = 0
        self._flights: dict[str, _Flight] = {}
        self.unstarted: dict[str, float] = {}  # routed, not yet computing: request id -> routed at
        self._last_arrival = 0.0
        for _ in range(spec.prefill_workers):
            self.add_worker("prefill")
        for _ in range(spec.decode_workers):
            self.add_worker("decode")

    # ---- pools -------------------------------------------------------------------------------
    def add_worker(self, role: str, ready_in_s: float = 0.0) -> str:
        """A new worker, routable once ready_in_s has passed (its start-up); it costs GPUs from now."""
        wid = f"{role}-{self._next_id[role]}"
        self._next_id[role] += 1
        cost = self.prefill_cost if role == "prefill" else self.cost
        w = SimWorker(self.loop, wid, role, cost, self.spec.engine)
        w.on_started = self._started
        w.alive = False
        self._state[wid] = "starting"
        self._stats[wid] = (0, 0, 0.0)
        self.workers[wid] = w
        self._born[wid] = self.loop.now
        self._queued[wid] = 0
        self.loop.after(ready_in_s, self._admit, wid)
        return wid

    def _admit(self, wid: str) -> None:
        if self._state[wid] != "starting":
            return
        self._state[wid] = "up"
        self.workers[wid].alive = True
        self._rebuild_infos()

    def drain_worker(self, role: str) -> str | None:
        """Stop routing to the newest worker of `role` (a starting one first); it leaves once idle.
        Never drains the last decode worker. Returns its id, or None."""
        candidates = [wid for wid, st in self._state.items() if st in ("starting", "up") and self.workers[wid].role == role]
        if len(candidates) <= (1 if role == "decode" else 0):
            return None
        wid = max(candidates, key=lambda x: (self._state[x] == "starting", self._born[x], x))
        self._state[wid] = "draining"
        self.workers[wid].alive = False
        self._rebuild_infos()
        self._retire_idle()
        return wid

    def _retire_idle(self) -> None:
        for wid, st in self._state.items():
            w = self.workers[wid]
            if st == "draining" and w.idle:
                self._state[wid] = "removed"
                w.removed = True
                self._gone[wid] = self.loop.now
                self.index.remove_worker(wid)

    def pool_size(self, role: str, include_starting: bool = True) -> int:
        states = ("up", "starting") if include_starting else ("up",)
        return sum(1 for wid, st in self._state.items() if st in states and self.workers[wid].role == role)

    # ---- what the router sees ----------------------------------------------------------------
    def _rebuild_infos(self) -> None:
        # A draining worker stays listed as not alive (as a dead one does for the real router).
        infos = []
        for wid, w in self.workers.items():
            if self._state[wid] in ("up", "draining"):
                running, waiting, usage = self._stats[wid]
                infos.append(WorkerInfo(wid, w.role, alive=self._state[wid] == "up", running=running, waiting=waiting,
                                        kv_usage=usage, queued_prefill_tokens=self._queued[wid]))
        self._infos = infos
        self._pos = {info.worker_id: i for i, info in enumerate(infos)}

    def _set_queued(self, wid: str, delta: int) -> None:
        self._queued[wid] = max(0, self._queued.get(wid, 0) + delta)
        i = self._pos.get(wid)
        if i is not None:
            self._infos[i] = dataclasses.replace(self._infos[i], queued_prefill_tokens=self._queued[wid])

    def _heartbeat(self) -> None:
        for wid, w in self.workers.items():
            if w.removed:
                continue
            self._stats[wid] = w.stats()
            events, snapshot = w.take_kv_events()
            if snapshot is not None:
                self.index.replace(wid, snapshot)
            else:
                self.index.apply(wid, events)
        self._retire_idle()
        self._rebuild_infos()
        self.timeline.append({
            "t": self.loop.now, "prefill_workers": self.pool_size("prefill", False),
            "decode_workers": self.pool_size("decode", False),
            "queued_prefill_tokens": sum(self._queued.values()),
            "prefill_busy": sum(1 for wid, w in self.workers.items() if w.role == "prefill" and not w.removed
                                and (self._stats[wid][0] or self._stats[wid][1])),
            "decode_waiting": sum(self._stats[wid][1] for wid, w in self.workers.items() if w.role == "decode"
                                  and not w.removed),
            "decode_running": sum(self._stats[wid][0] for wid, w in self.workers.items() if w.role == "decode"
                                  and not w.removed),
        })
        if not self._finished():
            self.loop.after(self.overheads.heartbeat_s, self._heartbeat)

    # ---- requests ----------------------------------------------------------------------------
    def _send(self, client: str, req: SimRequest, on_done: Callable[[], None]) -> None:
        rec = RequestRecord(req.request_id, client, len(req.prompt), req.output_len, self.loop.now)
        self.records.append(rec)
        self._last_arrival = max(self._last_arrival, self.loop.now)
        self.loop.after(self.overheads.router_s, self._route, _Flight(req, rec, on_done))

    def _route(self, f: _Flight) -> None:
        t0 = time.perf_counter()
        try:
            d = self.policy.choose(f.req.prompt, self._infos)
        except NoWorkerAvailable as exc:
            f.rec.failed = str(exc)
            self._end(f)
            return
        finally:
            self.decision_s.append(time.perf_counter() - t0)
        f.rec.route, f.rec.decode_worker, f.rec.prefill_worker = d.reason, d.decode_worker, d.prefill_worker
        f.queued_on, f.queued = d.prefill_worker or d.decode_worker, len(f.req.prompt)
        self._flights[f.req.request_id] = f
        self.unstarted[f.req.request_id] = self.loop.now
        self._set_queued(f.queued_on, f.queued)
        if d.prefill_worker is None:
            self._local(f)
        else:
            self._remote(f)

    def _started(self, request_id: str, queued_s: float) -> None:
        if self.unstarted.pop(request_id, None) is not None:
            f = self._flights.get(request_id)
            if f is not None:
                f.rec.queue_s = self.loop.now - f.rec.sent_s - self.overheads.router_s

    def _dequeue(self, f: _Flight) -> None:
        if f.queued:
            self._set_queued(f.queued_on, -f.queued)
            f.queued = 0

    def _local(self, f: _Flight) -> None:
        d = self.workers[f.rec.decode_worker]
        on_output = self._decode_output(f)
        self.loop.after(self.overheads.rpc_s / 2, d.call,
                        lambda: d.add(f.req.request_id, f.req.prompt, f.req.output_len, on_output))

    def _decode_output(self, f: _Flight):
        def on_output(rid: str, n: int, finished: bool, cached: int) -> None:
            if n == 1:
                f.rec.cached_tokens = cached
            self.loop.after(self.overheads.stream_s, self._client_token, f, finished)
        return on_output

    def _remote(self, f: _Flight) -> None:
        rpc = self.overheads.rpc_s / 2
        d, p = self.workers[f.rec.decode_worker], self.workers[f.rec.prefill_worker]
        rid, bs = f.req.request_id, self.spec.engine.block_size

        def reserve() -> None:
            res = d.reserve(rid, f.req.prompt, f.req.output_len, self._decode_output(f))
            self.loop.after(rpc, reserved, res)

        def reserved(res) -> None:
            if res is None:  # D is full right now: it prefills the request itself, queued there
                f.rec.route = "remote_prefill_fallback_local"
                f.rec.prefill_worker = None
                self._local(f)
                return
            _, cached = res
            def on_first(_rid: str, _n: int, finished: bool, p_cached: int) -> None:
                f.rec.cached_tokens = p_cached
                first_token(cached, finished)

            self.loop.after(rpc, p.call, lambda: p.add(rid, f.req.prompt, f.req.output_len, on_first, prefill_only=True))

        def first_token(d_cached: int, finished: bool) -> None:
            if finished:  # one-token request: the answer is P's token; D's reservation is freed beside it
                self.loop.after(rpc, to_router_finished)
                return
            begin_send(d_cached)  # on P's engine thread as the step ends (workers.worker)

        def begin_send(d_cached: int) -> None:
            blocks = p.begin_send(rid)
            skip = d_cached // bs
            sent = len(blocks) - skip
            p.counters.kv_blocks_sent += sent
            nbytes = sent * bs * self.prefill_cost.kv_bytes_per_token()
            self.loop.after(self.link.transfer_time(nbytes), sent_done)

        def sent_done() -> None:
            p.call(lambda: p.release(rid))  # queued for P's engine thread, not waited for
            self.loop.after(rpc, to_router)

        # The router passes the first token on at once; D's start_decode (or the abort of a
        # one-token request's reservation) goes out with it and waits for D's engine thread.
        def to_router() -> None:
            self._dequeue(f)
            self._client_token(f, False)
            self.loop.after(rpc, d.call, lambda: d.kv_arrived(rid))

        def to_router_finished() -> None:
            self._dequeue(f)
            self._client_token(f, True)
            self.loop.after(rpc, d.call, lambda: d.abort(rid))

        self.loop.after(rpc, d.call, reserve)

    def _client_token(self, f: _Flight, finished: bool) -> None:
        rec, now = f.rec, self.loop.now
        if rec.first_token_s is None:
            rec.first_token_s = now
            self._dequeue(f)
        elif self.record_itl:
            self.itl.add(now - rec.last_token_s)
        rec.tokens += 1
        rec.last_token_s = now
        if finished:
            rec.done_s = now
            self._end(f)

    def _end(self, f: _Flight) -> None:
        self._dequeue(f)
        self._flights.pop(f.req.request_id, None)
        self.unstarted.pop(f.req.request_id, None)
        if f.rec.completed:
            self.recent.append(f.rec)
        self._retire_idle()
        f.on_done()

    # ---- clients -----------------------------------------------------------------------------
    def _start_client(self, client: Client) -> None:
        """Closed loop: `concurrency` units in flight, the next one when one ends. Open loop (no
        concurrency): each unit starts at its first request's arrival, chained so only one is scheduled."""
        pending = deque(sorted(client.units, key=lambda u: u[0].arrival_s or 0.0) if client.concurrency is None
                        else client.units)
        in_flight = [0]
        if not pending:
            return
        self._open_clients += 1

        def launch() -> None:
            unit = pending.popleft()
            in_flight[0] += 1
            run(unit, 0)
            if client.concurrency is None and pending:
                nxt = pending[0][0]
                self.loop.at(client.start_s + (nxt.arrival_s or 0.0), launch)

        def unit_done() -> None:
            in_flight[0] -= 1
            if pending and client.concurrency is not None:
                launch()
            elif not pending and in_flight[0] == 0:
                self._open_clients -= 1

        def run(unit: tuple[SimRequest, ...], i: int) -> None:
            req = unit[i]

            def done() -> None:
                if i + 1 < len(unit):
                    self.loop.after(client.think_s, run, unit, i + 1)
                else:
                    unit_done()

            t = client.start_s + req.arrival_s if (req.arrival_s is not None and i == 0) else self.loop.now
            self.loop.at(t, self._send, client.name, req, done)

        if client.concurrency is None:
            self.loop.at(client.start_s + (pending[0][0].arrival_s or 0.0), launch)
        else:
            for _ in range(min(client.concurrency, len(pending))):
                launch()

    def _finished(self) -> bool:
        return self._open_clients == 0

    def every(self, interval_s: float, fn: Callable[["Simulator"], None]) -> None:
        """Call fn(simulator) every interval_s of simulated time while clients are running (the autoscaler)."""
        def tick() -> None:
            fn(self)
            if not self._finished():
                self.loop.after(interval_s, tick)
        self.loop.after(interval_s, tick)

    def run(self, workload: Workload) -> SimResult:
        started = time.perf_counter()
        self._rebuild_infos()
        for client in workload.clients:
            self._start_client(client)
        last_open = max((r.arrival_s or 0.0) + c.start_s for c in workload.clients for r in c.requests)
        self._heartbeat()
        self.loop.run(until=last_open + self.spec.drain_limit_s, stop=self._finished)
        for rec in self.records:
            if rec.done_s is None and not rec.failed:
                rec.failed = "not finished when the simulation stopped"
        end = self.loop.now
        pools = {}
        for role in ("prefill", "decode"):
            ws = [w for w in self.workers.values() if w.role == role]
            pools[role] = PoolStats(
                workers=self.pool_size(role, False),
                gpu_seconds=sum((self._gone.get(w.worker_id, end) - self._born[w.worker_id]) * w.cost.gpus_per_worker()
                                for w in ws),
                busy_seconds=sum(w.counters.busy_s for w in ws), steps=sum(w.counters.steps for w in ws),
                prefill_tokens=sum(w.counters.prefill_tokens for w in ws),
                decode_tokens=sum(w.counters.decode_tokens for w in ws),
                queue_s=[q for w in ws for q in w.counters.queue_s])
        config = {"prefill_workers": self.spec.prefill_workers, "decode_workers": self.spec.decode_workers,
                  "engine": dataclasses.asdict(self.spec.engine), "routing": dataclasses.asdict(self.spec.routing),
                  "overheads": dataclasses.asdict(self.overheads), "link": dataclasses.asdict(self.link),
                  "cost_model": _describe(self.cost), "prefill_cost_model": _describe(self.prefill_cost)}
        return SimResult(self.records, self.itl, pools, self.timeline, self.decision_s, end,
                         time.perf_counter() - started, config)


def _describe(cost: CostModel) -> dict:
    to_dict = getattr(cost, "to_dict", None)
    return to_dict() if to_dict else {"kind": type(cost).__name__}


def simulate(workload: Workload, spec: ClusterSpec, cost: CostModel, overheads: ServingOverheads | None = None,
             link: LinkModel | None = None, prefill_cost: CostModel | None = None) -> SimResult:
    """Run one workload on one deployment and return its records and pool statistics."""
    return Simulator(spec, cost, overheads, link, prefill_cost).run(workload)
