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

`Autoscaler.decide` is pure (signals in, target sizes out), so the simulator
(`cluster.sim.autoscaling.attach_to_simulator`) and the real driver loop
(`cluster.autoscaler_loop.AutoscalerLoop`, over `cluster.pool_manager.PoolManager`) run the same
decisions. Each reads its signals through a `SignalSource`: `RouterSignals` (cluster/autoscaler_loop.py)
over the running router's traces and worker snapshot, `SimulatorSignals` (cluster/sim/autoscaling.py)
over a simulation's public records. This module imports neither FastAPI nor Ray nor the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from cluster.autoscaler_config import AutoscalerConfig
from common.roles import Role
from common.stats import percentile

__all__ = ["Autoscaler", "Decision", "SignalSource", "Signals", "p90"]


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


def p90(values: list[float]) -> float | None:
    """The 90th percentile of a window's values (None for an empty window), as the signals take it."""
    return percentile(values, 90) if values else None
