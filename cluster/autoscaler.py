"""The autoscaler: reads the router's own signals and asks the pool manager for more or fewer workers.

Every `interval_s` it looks at the last `window_s` of traffic, per pool:

- prefill pressure = max(queue time / TTFT SLO, TTFT p90 / TTFT SLO while that queue time is at
  least `scale_down_at` of the SLO), the queue time being the larger of the p90 of requests'
  waits from routing to their first computed chunk in the window, and the wait so far of the
  oldest request not computing yet (a backlog shows before its requests finish);
- decode pressure = max(TPOT p90 / TPOT SLO, 1 + waiting / running when sequences wait for a
  decode slot or KV blocks).

A pool whose pressure exceeds `scale_up_at` grows by max(1, round(n * (pressure - 1))) workers (at
most doubling). A pool shrinks by one after `down_after` low checks in a row: for decode, the
pressure one worker fewer would give (TPOT x n / (n - 1)) below `scale_down_at`, with no sequence
waiting and no prefill queue (decode workers prefill when the prefill pool is small); for prefill
(whose TTFT includes the prefill itself, however idle the pool), queue pressure below
`scale_down_at` and a busy fraction (heartbeats at which a prefill worker had work) low enough that
n - 1 workers would be busy at most half the time. Hysteresis (the gap between the two thresholds,
and `down_after`), a per-pool cool-down after every change (`cooldown_s`) and no shrinking within
two cool-downs of growing keep it from oscillating; sizes stay within each pool's min and max. Off
by default (`--autoscale`).

`Autoscaler.decide` is pure (signals in, target sizes out), so the simulator (`attach_to_simulator`)
and the real driver loop (`AutoscalerLoop`, over `cluster.pool_manager.PoolManager`) run the same
decisions. Each reads its signals through a `SignalSource`: `RouterSignals` over the running
router's traces and worker snapshot, `SimulatorSignals` over a simulation's public records.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cluster.autoscaler_config import AutoscalerConfig
from common.roles import Role
from common.stats import percentile
from router.app import run_during_lifespan

if TYPE_CHECKING:  # annotations only: the serving path imports this module without the simulator
    from cluster.sim.simulator import Simulator

__all__ = [
    "Autoscaler",
    "AutoscalerLoop",
    "Decision",
    "RouterSignals",
    "SignalSource",
    "Signals",
    "SimulatorSignals",
    "attach_to_simulator",
    "install_autoscaler",
]

log = logging.getLogger("baton.autoscaler")


@dataclass(frozen=True)
class Signals:
    """What the router knows about the last window."""

    now: float
    prefill_workers: int  # serving or starting
    decode_workers: int
    ttft_p90_s: float | None  # of requests that got their first token in the window
    tpot_p90_s: float | None  # of requests that finished in the window
    queued_prefill_tokens: int  # routed, first token not yet
    queue_p90_s: float | None  # routing to first computed chunk, of requests started in the window
    oldest_queued_s: float  # how long the oldest routed request not computing yet has waited
    decode_running: int
    decode_waiting: int
    prefill_busy_fraction: float = 0.0  # of prefill workers' heartbeats in the window, with work to do


@dataclass(frozen=True)
class Decision:
    prefill_workers: int
    decode_workers: int
    prefill_pressure: float
    decode_pressure: float
    reason: str

    def changes(self, s: Signals) -> bool:
        return (self.prefill_workers, self.decode_workers) != (s.prefill_workers, s.decode_workers)


class Autoscaler:
    """Decisions with hysteresis and cool-down; keeps only its counters and the last change times."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._changed_at = {"prefill": -math.inf, "decode": -math.inf}
        self._grew_at = {"prefill": -math.inf, "decode": -math.inf}
        self._low = {"prefill": 0, "decode": 0}
        self.history: list[tuple[Signals, Decision]] = []
        self.actions: list[dict] = []  # every change a simulation made on its decisions (reports read them)

    def queue_pressure(self, s: Signals) -> float:
        return min(10.0, max(s.queue_p90_s or 0.0, s.oldest_queued_s) / self.config.slo_ttft_s)

    def pressures(self, s: Signals) -> tuple[float, float]:
        """(prefill, decode). A prefill worker more only helps when prompts queue: TTFT counts only
        while the queue holds at least scale_down_at of the SLO (a TTFT near the SLO with no queue
        is the prefill itself, which more workers would not shorten)."""
        c = self.config
        queue = self.queue_pressure(s)
        ttft = (s.ttft_p90_s or 0.0) / c.slo_ttft_s
        prefill = max(queue, ttft if queue >= c.scale_down_at else min(ttft, c.scale_up_at))
        decode = (s.tpot_p90_s or 0.0) / c.slo_tpot_s
        if s.decode_waiting:
            decode = max(decode, 1.0 + s.decode_waiting / max(1, s.decode_running))
        return prefill, decode

    def decide(self, s: Signals) -> Decision:
        c = self.config
        pp, dp = self.pressures(s)
        sizes = {"prefill": s.prefill_workers, "decode": s.decode_workers}
        bounds = {
            "prefill": (c.min_prefill_workers, c.max_prefill_workers),
            "decode": (c.min_decode_workers, c.max_decode_workers),
        }
        reasons = []
        for role, pressure in (("prefill", pp), ("decode", dp)):
            n = sizes[role]
            lo, hi = bounds[role]
            target = min(hi, max(lo, n))
            if s.now - self._changed_at[role] >= c.cooldown_s:
                if pressure > c.scale_up_at and n < hi:
                    step = max(1, round(n * (pressure - 1))) if n else 1
                    target = min(hi, n + min(step, max(1, n)))
                    reasons.append(f"{role} pressure {pressure:.2f} > {c.scale_up_at}")
                if role == Role.PREFILL:
                    low = (
                        self.queue_pressure(s) < c.scale_down_at
                        and pressure <= c.scale_up_at
                        and s.prefill_busy_fraction * n / max(1, n - 1) < 0.5
                    )
                else:  # the TPOT one worker fewer would give (batches grow by n / (n - 1)), and no queue
                    low = (
                        pressure * n / max(1, n - 1) < c.scale_down_at
                        and not s.decode_waiting
                        and self.queue_pressure(s) < c.scale_down_at
                    )
                self._low[role] = self._low[role] + 1 if low else 0
                # A pool that grew shrinks no sooner than two cool-downs later (a stabilization window,
                # as Kubernetes' HPA holds scale-downs): a burst's aftermath, e.g. the wave of prompts
                # a prefill backlog releases, must not have it grow and shrink back in turn.
                stable = s.now - self._grew_at[role] >= 2 * c.cooldown_s
                if target == n and self._low[role] >= c.down_after and n > lo and stable:
                    target = n - 1
                    reasons.append(f"{role} pressure below {c.scale_down_at} for {self._low[role]} checks")
            if target != n:
                self._changed_at[role] = s.now
                self._low[role] = 0
                if target > n:
                    self._grew_at[role] = s.now
            sizes[role] = target
        decision = Decision(sizes["prefill"], sizes["decode"], pp, dp, "; ".join(reasons) or "hold")
        self.history.append((s, decision))
        return decision


class SignalSource(Protocol):
    """Where the autoscaler reads the last window from."""

    def __call__(self) -> Signals: ...


def _p90(values: list[float]) -> float | None:
    return percentile(values, 90) if values else None


class SimulatorSignals:
    """The router's signals, as the simulated router has them (a simulation's public records)."""

    def __init__(self, sim: Simulator, window_s: float) -> None:
        self.sim = sim
        self.window_s = window_s

    def __call__(self) -> Signals:
        sim, window_s = self.sim, self.window_s
        now = sim.loop.now
        while sim.recent and sim.recent[0].done_s < now - window_s:
            sim.recent.popleft()
        first = [r for r in sim.records if r.first_token_s is not None and r.first_token_s >= now - window_s]
        ttft = _p90([r.ttft_s for r in first])
        waits = [r.queue_s for r in first if r.queue_s is not None]
        tpot = _p90([r.tpot_s for r in sim.recent if r.tpot_s is not None])
        running, waiting = sim.decode_load()
        beats = [p for p in sim.timeline if p["t"] >= now - window_s]
        busy = sum(p["prefill_busy"] for p in beats) / max(1, sum(p["prefill_workers"] for p in beats))
        return Signals(
            now,
            sim.pool_size("prefill"),
            sim.pool_size("decode"),
            ttft,
            tpot,
            sim.queued_prefill_tokens(),
            _p90(waits),
            now - min(sim.unstarted.values(), default=now),
            running,
            waiting,
            busy,
        )


def attach_to_simulator(sim: Simulator, config: AutoscalerConfig, startup_s: float = 30.0) -> Autoscaler:
    """Run the autoscaler inside a simulation; new workers serve `startup_s` after they are asked for.
    The changes it made are in the returned autoscaler's `actions`."""
    scaler = Autoscaler(config)
    actions = scaler.actions
    source = SimulatorSignals(sim, config.window_s)

    def tick(s: Simulator) -> None:
        signals = source()
        d = scaler.decide(signals)
        for role, now_n, want in (
            ("prefill", signals.prefill_workers, d.prefill_workers),
            ("decode", signals.decode_workers, d.decode_workers),
        ):
            for _ in range(want - now_n):
                s.add_worker(role, ready_in_s=startup_s)
            for _ in range(now_n - want):
                s.drain_worker(role)
            if want != now_n:
                actions.append({"t": s.loop.now, "pool": role, "from": now_n, "to": want, "reason": d.reason})

    sim.every(config.interval_s, tick)
    return scaler


class AutoscalerLoop:
    """The driver-side loop: every interval, signals from the router, sizes to the pool manager.

    `signals` reads the router (queue and trace data of the running app); `scale(prefill, decode)`
    is `PoolManager.scale`. Runs on the router's event loop until `stop()`.
    """

    def __init__(
        self, config: AutoscalerConfig, signals: SignalSource, scale: Callable[[int, int], Awaitable[object]]
    ) -> None:
        self.config = config
        self.autoscaler = Autoscaler(config)
        self._signals = signals
        self._scale = scale
        self._task: asyncio.Task | None = None
        self.actions: list[dict] = []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                s = self._signals()
                d = self.autoscaler.decide(s)
                if d.changes(s):
                    log.info(
                        "autoscaler: prefill %d -> %d, decode %d -> %d (%s)",
                        s.prefill_workers,
                        d.prefill_workers,
                        s.decode_workers,
                        d.decode_workers,
                        d.reason,
                    )
                    self.actions.append(
                        {
                            "t": s.now,
                            "from": [s.prefill_workers, s.decode_workers],
                            "to": [d.prefill_workers, d.decode_workers],
                            "reason": d.reason,
                        }
                    )
                    await self._scale(d.prefill_workers, d.decode_workers)
            except Exception:  # a failed scaling must not end the loop; the next interval retries
                log.exception("autoscaler step failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class RouterSignals:
    """The running router's signals: finished requests' traces (RouterMetrics.recent) for TTFT,
    TPOT and queue time, and the backend's worker snapshot for queues and the prefill pool's busy
    fraction (sampled at every call, averaged over the window)."""

    def __init__(self, metrics, backend, targets: Callable[[], tuple[int, int]], window_s: float) -> None:
        self.metrics = metrics
        self.backend = backend
        self.targets = targets
        self.window_s = window_s
        self._busy: deque[tuple[float, int, int]] = deque()

    def __call__(self) -> Signals:
        now = time.time()
        since = now - self.window_s
        traces = [tr for t, tr in list(self.metrics.recent) if t >= since and tr.error is None]
        ttft = [tr.ttft_s for tr in traces if tr.ttft_s is not None]
        tpot = [
            (tr.e2e_s - tr.ttft_s) / (tr.output_tokens - 1)
            for tr in traces
            if tr.e2e_s is not None and tr.ttft_s is not None and tr.output_tokens > 1
        ]
        queue = [tr.queue_s for tr in traces]
        workers = [w for w in self.backend.workers() if w.alive]
        prefill = [w for w in workers if w.role == Role.PREFILL]
        decode = [w for w in workers if w.role == Role.DECODE]
        self._busy.append((now, sum(1 for w in prefill if w.running or w.waiting), len(prefill)))
        while self._busy and self._busy[0][0] < since:
            self._busy.popleft()
        busy = sum(b for _, b, _ in self._busy) / max(1, sum(n for _, _, n in self._busy))
        p, d = self.targets()
        return Signals(
            now,
            p,
            d,
            _p90(ttft),
            _p90(tpot),
            sum(w.queued_prefill_tokens for w in workers),
            _p90(queue),
            0.0,
            sum(w.running for w in decode),
            sum(w.waiting for w in decode),
            busy,
        )


def install_autoscaler(app, pools, backend, config: AutoscalerConfig) -> AutoscalerLoop:
    """Run the autoscaler on the router's event loop from start-up: signals from the app's metrics
    and the backend, sizes to the pool manager (`cluster.pool_manager.PoolManager.scale`)."""
    signals = RouterSignals(
        app.state.baton.metrics, backend, lambda: (pools.targets.prefill, pools.targets.decode), config.window_s
    )
    loop = AutoscalerLoop(config, signals, lambda p, d: pools.scale(prefill=p, decode=d))
    run_during_lifespan(app, loop.start, lambda _: loop.stop())
    app.state.autoscaler = loop
    return loop
