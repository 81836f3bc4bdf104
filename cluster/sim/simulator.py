"""The cluster simulator: a Baton deployment as a discrete-event simulation.

Each request is driven by the router's own `router.flow.RequestFlow`, whose commands run here as
events on simulated workers instead of Ray calls (`_execute`), with the router's real routing
policy (`router.routing.make_policy`: `KvAwarePolicy` by default) and real
`router.prefix_index.PrefixIndex`, fed by the simulated workers' KV events at every heartbeat as
the router's health loop feeds it. What is the simulator's own is how long each command takes:
a call to a worker waits for the end of its current step; a prefill (`prefill_only`) starts its
send as P's step ends, the KV moves over the `LinkModel`, and P's release of the blocks is queued
between its steps; outputs reach the router `stream_s` after the worker's step.

The router's queued-prefill count (the policy's queue term) follows the flow's commands, and the
router sees worker stats (running, waiting, KV usage) as of
the last heartbeat. Pools can grow and shrink while it runs (`add_worker`, `drain_worker`): what
the autoscaler drives.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.sim.costs import CostModel, LinkModel, ServingOverheads
from cluster.sim.engine import EngineSettings, EventLoop, SimWorker
from cluster.sim.metrics import ItlSample, PoolStats, RequestRecord, SimResult
from cluster.sim.workload import Client, SimRequest, Workload
from common.protocol import KVReservation, PrefillResult, RequestOutput
from common.roles import ROLES, Role
from router.backend import WorkerInfo
from router.flow import (
    COUNTERS,
    Abort,
    Command,
    Count,
    Emit,
    Fail,
    Follow,
    MigrationGap,
    Prefill,
    QueueTokens,
    RequestFlow,
    Reserve,
    StartDecode,
    Submit,
    WaitForDecode,
)
from router.migration import pick_worker
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
            raise ValueError(
                f"need prefill_workers >= 0 and decode_workers >= 1, got {self.prefill_workers}, {self.decode_workers}"
            )


@dataclass
class _Flight:
    """One request in the router: its record, its flow, and what to call when it ends."""

    req: SimRequest
    rec: RequestRecord
    on_done: Callable[[], None]
    flow: RequestFlow | None = None


class Simulator:
    def __init__(
        self,
        spec: ClusterSpec,
        cost: CostModel,
        overheads: ServingOverheads | None = None,
        link: LinkModel | None = None,
        prefill_cost: CostModel | None = None,
        record_itl: bool = True,
    ) -> None:
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
        self._tickers: list[tuple[float, Callable[[Simulator], None]]] = []
        self._open_clients = 0
        self._stopped = False
        self._flights: dict[str, _Flight] = {}
        self.unstarted: dict[str, float] = {}  # routed, not yet computing: request id -> routed at
        self.counters = dict.fromkeys(COUNTERS, 0)  # what the flows counted, as RayBackend.counters
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
        cost = self.prefill_cost if role == Role.PREFILL else self.cost
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
        candidates = [
            wid for wid, st in self._state.items() if st in ("starting", "up") and self.workers[wid].role == role
        ]
        if len(candidates) <= (1 if role == Role.DECODE else 0):
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

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens routed and not prefilled yet, over all workers (as the router counts them)."""
        return sum(self._queued.values())

    def decode_load(self) -> tuple[int, int]:
        """(running, waiting) sequences over the decode pool, as of the last heartbeat."""
        stats = [self._stats[wid] for wid, w in self.workers.items() if w.role == Role.DECODE and not w.removed]
        return sum(s[0] for s in stats), sum(s[1] for s in stats)

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
                infos.append(
                    WorkerInfo(
                        wid,
                        w.role,
                        alive=self._state[wid] == "up",
                        running=running,
                        waiting=waiting,
                        kv_usage=usage,
                        queued_prefill_tokens=self._queued[wid],
                    )
                )
        self._infos = infos
        self._pos = {info.worker_id: i for i, info in enumerate(infos)}

    # router.flow.WorkerPicker: where a request goes when the policy is not asked again.
    def usable(self, worker_id: str) -> bool:
        return self._state.get(worker_id) == "up"

    def pick(self, role: Role, exclude: frozenset[str] = frozenset()) -> str | None:
        return pick_worker((info for info in self._infos if info.role == role), exclude)

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
        self.timeline.append(
            {
                "t": self.loop.now,
                "prefill_workers": self.pool_size("prefill", False),
                "decode_workers": self.pool_size("decode", False),
                "queued_prefill_tokens": sum(self._queued.values()),
                "prefill_busy": sum(
                    1
                    for wid, w in self.workers.items()
                    if w.role == Role.PREFILL and not w.removed and (self._stats[wid][0] or self._stats[wid][1])
                ),
                "decode_waiting": sum(
                    self._stats[wid][1] for wid, w in self.workers.items() if w.role == Role.DECODE and not w.removed
                ),
                "decode_running": sum(
                    self._stats[wid][0] for wid, w in self.workers.items() if w.role == Role.DECODE and not w.removed
                ),
            }
        )
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
        self._flights[f.req.request_id] = f
        self.unstarted[f.req.request_id] = self.loop.now
        f.flow = RequestFlow(f.req.request_id, len(f.req.prompt), d, self)
        self._execute(f, f.flow.start(self.loop.now))

    def _started(self, request_id: str, queued_s: float) -> None:
        if self.unstarted.pop(request_id, None) is not None:
            f = self._flights.get(request_id)
            if f is not None:
                f.rec.queue_s = self.loop.now - f.rec.sent_s - self.overheads.router_s

    # ---- the flow's commands, carried out as events ------------------------------------------
    def _answer(self, f: _Flight, handler: Callable[[float], list[Command]]) -> None:
        """An outcome reached the router: ask the flow what next, and do it."""
        if f.flow.done:
            return
        self._execute(f, handler(self.loop.now))

    def _execute(self, f: _Flight, commands: list[Command]) -> None:
        rpc = self.overheads.rpc_s / 2
        rid, flow = f.req.request_id, f.flow
        for c in commands:
            if isinstance(c, Emit):
                self._client_token(f, c.output.finished)
            elif isinstance(c, QueueTokens):
                self._set_queued(c.worker_id, c.delta)
            elif isinstance(c, Count):
                self.counters[c.name] += c.n
            elif isinstance(c, Follow):
                f.rec.decode_worker = c.worker_id
            elif isinstance(c, Reserve):
                d = self.workers[c.worker_id]

                def reserve(d: SimWorker = d) -> None:
                    res = d.reserve(rid, f.req.prompt, f.req.output_len, self._decode_output(f))
                    reservation = None if res is None else KVReservation(rid, list(range(res[0])), res[1])
                    self.loop.after(rpc, self._answer, f, lambda now: flow.on_reserved(reservation, now))

                self.loop.after(rpc, d.call, reserve)
            elif isinstance(c, Prefill):
                self._prefill(f, c)
            elif isinstance(c, StartDecode):
                d = self.workers[c.worker_id]
                self.loop.after(rpc, d.call, lambda d=d: d.kv_arrived(rid))
            elif isinstance(c, Submit):
                assert c.resume is None, "the simulator loses no worker, so nothing migrates"
                d = self.workers[c.worker_id]
                self.loop.after(
                    rpc, d.call, lambda d=d: d.add(rid, f.req.prompt, f.req.output_len, self._decode_output(f))
                )
            elif isinstance(c, Abort):
                w = self.workers[c.worker_id]
                self.loop.after(rpc, w.call, lambda w=w: w.abort(rid))
            elif isinstance(c, Fail):
                f.rec.failed = c.message
                self._end(f)
            elif isinstance(c, WaitForDecode):
                self.loop.after(0.1, self._answer, f, flow.on_wait)
            elif isinstance(c, MigrationGap):
                pass  # no worker is lost in the simulation
            else:
                raise AssertionError(f"no executor for {c!r}")

    def _prefill(self, f: _Flight, c: Prefill) -> None:
        """P computes the prompt (`prefill_only`); the send starts as its step ends (as on P's engine
        thread), the KV moves over the link, P's release of the blocks is queued between its steps,
        and the outcome reaches the router one RPC later."""
        rpc = self.overheads.rpc_s / 2
        rid, flow, p, bs = f.req.request_id, f.flow, self.workers[c.worker_id], self.spec.engine.block_size

        def done(finished: bool, p_cached: int, blocks: int, nbytes: int, transfer_s: float) -> None:
            result = PrefillResult(
                RequestOutput(rid, [0], finished=finished, num_cached_tokens=p_cached), blocks, nbytes, transfer_s, 0.0
            )
            self.loop.after(rpc, self._answer, f, lambda now: flow.on_prefill_done(result, now))

        def on_first(_rid: str, _n: int, finished: bool, p_cached: int) -> None:
            if finished:  # a one-token request: P's token is the answer, nothing moves
                done(True, p_cached, 0, 0, 0.0)
                return
            blocks = p.begin_send(rid)
            sent = len(blocks) - c.reservation.num_cached_tokens // bs
            p.counters.kv_blocks_sent += sent
            nbytes = sent * bs * self.prefill_cost.kv_bytes_per_token()
            transfer_s = self.link.transfer_time(nbytes)

            def sent_done() -> None:
                p.call(lambda: p.release(rid))  # queued for P's engine thread, not waited for
                done(False, p_cached, sent, nbytes, transfer_s)

            self.loop.after(transfer_s, sent_done)

        self.loop.after(rpc, p.call, lambda: p.add(rid, f.req.prompt, f.req.output_len, on_first, prefill_only=True))

    def _decode_output(self, f: _Flight):
        stream_s, after, deliver = self.overheads.stream_s, self.loop.after_grouped, self._deliver

        def on_output(rid: str, n: int, finished: bool, cached: int) -> None:
            # One step's increment: the one token it sampled (n counts every token so far).
            after(stream_s, deliver, f, RequestOutput(rid, [0], finished=finished, num_cached_tokens=cached))

        return on_output

    def _deliver(self, f: _Flight, out: RequestOutput) -> None:
        """A decode worker's output reached the router (`_answer` for the commonest outcome, without
        a closure per token)."""
        flow = f.flow
        if flow.done:
            return
        commands = flow.on_output(out, self.loop.now)
        if len(commands) == 1 and type(commands[0]) is Emit:  # a token and nothing else: most of them
            self._client_token(f, commands[0].output.finished)
        else:
            self._execute(f, commands)

    def _client_token(self, f: _Flight, finished: bool) -> None:
        rec, now = f.rec, self.loop.now
        if rec.first_token_s is None:
            rec.first_token_s = now
        elif self.record_itl:
            self.itl.add(now - rec.last_token_s)
        rec.tokens += 1
        rec.last_token_s = now
        if finished:
            rec.done_s = now
            self._end(f)

    def _end(self, f: _Flight) -> None:
        if f.flow is not None:
            trace = f.flow.trace
            f.rec.cached_tokens, f.rec.prefill_worker = trace.cached_tokens, trace.prefill_worker
            if trace.fell_back_to_local:
                f.rec.route = "remote_prefill_fallback_local"
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
        pending = deque(
            sorted(client.units, key=lambda u: u[0].arrival_s or 0.0) if client.concurrency is None else client.units
        )
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
            self._start_client(client)
        last_open = max((r.arrival_s or 0.0) + c.start_s for c in workload.clients for r in c.requests)
        self._heartbeat()
        self.loop.run(until=last_open + self.spec.drain_limit_s, stop=self._finished)
        for rec in self.records:
            if rec.done_s is None and not rec.failed:
                rec.failed = "not finished when the simulation stopped"
        end = self.loop.now
        pools = {}
        for role in ROLES:
            ws = [w for w in self.workers.values() if w.role == role]
            pools[role] = PoolStats(
                workers=self.pool_size(role, False),
                gpu_seconds=sum(
                    (self._gone.get(w.worker_id, end) - self._born[w.worker_id]) * w.cost.gpus_per_worker() for w in ws
                ),
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
        }
        return SimResult(
            self.records, self.itl, pools, self.timeline, self.decision_s, end, time.perf_counter() - started, config
        )


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
) -> SimResult:
    """Run one workload on one deployment and return its records and pool statistics."""
    return Simulator(spec, cost, overheads, link, prefill_cost).run(workload)
