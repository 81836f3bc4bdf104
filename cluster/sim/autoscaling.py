"""The autoscaler inside a simulation: `SimulatorSignals` reads the signals a simulated router would
have from a simulation's public records, and `attach_to_simulator` runs `cluster.autoscaler.Autoscaler`'s
decisions on the simulation's clock, adding and draining simulated workers."""

from __future__ import annotations

from cluster.autoscaler import Autoscaler, Signals, p90
from cluster.autoscaler_config import AutoscalerConfig
from cluster.sim.simulator import Simulator
from common.roles import Role

__all__ = ["SimulatorSignals", "attach_to_simulator"]


class SimulatorSignals:
    """The router's signals, as the simulated router has them (a simulation's public records)."""

    def __init__(self, sim: Simulator, window_s: float) -> None:
        self.sim = sim
        self.window_s = window_s

    def __call__(self) -> Signals:
        sim, window_s = self.sim, self.window_s
        now = sim.loop.now
        # Completed records only (done_s set).
        while sim.recent and (done_s := sim.recent[0].done_s) is not None and done_s < now - window_s:
            sim.recent.popleft()
        first = [r for r in sim.records if r.first_token_s is not None and r.first_token_s >= now - window_s]
        ttft = p90([r.ttft_s for r in first])
        waits = [r.queue_s for r in first if r.queue_s is not None]
        tpot = p90([r.tpot_s for r in sim.recent if r.tpot_s is not None])
        running, waiting = sim.decode_load()
        beats = [p for p in sim.timeline if p["t"] >= now - window_s]
        busy = sum(p["prefill_busy"] for p in beats) / max(1, sum(p["prefill_workers"] for p in beats))
        return Signals(
            now,
            sim.pool_size(Role.PREFILL),
            sim.pool_size(Role.DECODE),
            ttft,
            tpot,
            sim.queued_prefill_tokens(),
            p90(waits),
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
            (Role.PREFILL, signals.prefill_workers, d.prefill_workers),
            (Role.DECODE, signals.decode_workers, d.decode_workers),
        ):
            for _ in range(want - now_n):
                s.add_worker(role, ready_in_s=startup_s)
            for _ in range(now_n - want):
                s.drain_worker(role)
            if want != now_n:
                actions.append({"t": s.loop.now, "pool": role, "from": now_n, "to": want, "reason": d.reason})

    sim.every(config.interval_s, tick)
    return scaler
