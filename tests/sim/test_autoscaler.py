"""The autoscaler: its decisions (hysteresis, cool-down, bounds), and a load step in the simulator."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from types import SimpleNamespace

import pytest
from fastapi import FastAPI

from cluster.autoscaler import Autoscaler, Signals
from cluster.autoscaler_config import AutoscalerConfig
from cluster.autoscaler_loop import AutoscalerLoop, RouterSignals, install_autoscaler
from cluster.config import BatonConfig
from cluster.sim import SLO, ClusterSpec, LengthDist, ServingOverheads, Simulator, WorkloadSpec
from cluster.sim.autoscaling import attach_to_simulator
from router.backend import WorkerInfo
from router.trace import RequestTrace
from tests.sim.machine import MACHINE_COST

CONFIG = AutoscalerConfig(
    enabled=True,
    interval_s=5,
    window_s=20,
    slo_ttft_s=3.0,
    slo_tpot_s=0.25,
    min_prefill_workers=0,
    max_prefill_workers=3,
    max_decode_workers=4,
    down_after=3,
    cooldown_s=30,
)


def signals(now, p=1, d=1, ttft=0.5, tpot=0.05, queue=0.0, oldest=0.0, waiting=0, busy=0.5) -> Signals:
    return Signals(now, p, d, ttft, tpot, 1000 if queue or oldest else 0, queue, oldest, 8, waiting, busy)


def test_a_queue_grows_the_prefill_pool_and_the_cool_down_holds_it():
    a = Autoscaler(CONFIG)
    d = a.decide(signals(0, queue=6.0))  # queue twice the TTFT SLO: pressure 2 -> one more (of 1)
    assert (d.prefill_workers, d.decode_workers) == (2, 1)
    assert a.decide(signals(10, p=2, queue=9.0)).prefill_workers == 2  # cooling down
    assert a.decide(signals(31, p=2, queue=9.0)).prefill_workers == 3  # pressure 3: doubling, capped at max 3
    assert a.decide(signals(70, p=3, queue=30.0)).prefill_workers == 3


def test_a_slow_ttft_without_a_queue_adds_no_prefill_worker():
    a = Autoscaler(CONFIG)
    assert a.decide(signals(0, ttft=2.9, queue=0.1)).prefill_workers == 1  # the prefill itself is slow, not queued


def test_tpot_and_waiting_sequences_grow_the_decode_pool():
    a = Autoscaler(CONFIG)
    assert a.decide(signals(0, tpot=0.3)).decode_workers == 2
    b = Autoscaler(CONFIG)
    assert b.decide(signals(0, d=2, waiting=8)).decode_workers == 4  # 1 + 8/8 = pressure 2: +2


def test_shrinking_needs_several_quiet_checks_in_a_row_and_stops_at_the_minimum():
    a = Autoscaler(CONFIG)
    quiet = dict(p=2, d=2, ttft=0.3, tpot=0.02, busy=0.1)
    assert a.decide(signals(0, **quiet)).decode_workers == 2
    assert a.decide(signals(5, **quiet)).decode_workers == 2
    d = a.decide(signals(10, **quiet))
    assert (d.prefill_workers, d.decode_workers) == (1, 1)
    a2 = Autoscaler(CONFIG)
    a2.decide(signals(0, **quiet))
    a2.decide(signals(5, **{**quiet, "tpot": 0.2}))  # one busy check resets the count
    assert a2.decide(signals(10, **quiet)).decode_workers == 2
    floor = Autoscaler(CONFIG)
    for t in range(0, 100, 5):
        d = floor.decide(signals(t, p=0, d=1, ttft=0.1, tpot=0.01, busy=0.0))
    assert (d.prefill_workers, d.decode_workers) == (0, 1)


def test_a_busy_prefill_pool_does_not_shrink():
    a = Autoscaler(CONFIG)
    for t in (0, 5, 10, 15):
        d = a.decide(signals(t, p=2, ttft=0.3, busy=0.4))  # 1 worker would be busy 80% of the time
    assert d.prefill_workers == 2


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="hysteresis"):
        AutoscalerConfig(scale_up_at=0.5, scale_down_at=0.6)
    with pytest.raises(ValueError, match="min_decode_workers"):
        AutoscalerConfig(min_decode_workers=3, max_decode_workers=2)
    config = BatonConfig.from_options(autoscale=True, max_decode_workers=6, autoscale_cooldown=20.0)
    assert config.autoscaler.enabled and config.autoscaler.max_decode_workers == 6


def test_a_load_step_grows_then_shrinks_the_pools_without_oscillating():
    cost = MACHINE_COST
    spec = WorkloadSpec(
        rate=4.0,
        duration_s=420,
        prompt_len=LengthDist("uniform", low=128, high=512),
        output_len=LengthDist("uniform", low=32, high=96),
        seed=5,
        rate_points=((0, 0.15), (120, 0.15), (120.01, 1.0), (270, 1.0), (270.01, 0.15)),
    )
    wl = spec.generate()
    sim = Simulator(ClusterSpec(1, 1), cost, ServingOverheads(), record_itl=False)
    config = dataclasses.replace(CONFIG, min_prefill_workers=1)
    scaler = attach_to_simulator(sim, config, startup_s=8)
    auto = sim.run(wl).summary(SLO(3.0, 0.25))
    static = Simulator(ClusterSpec(1, 1), cost, ServingOverheads(), record_itl=False).run(wl).summary(SLO(3.0, 0.25))
    actions = scaler.actions
    grew = [a for a in actions if a["to"] > a["from"]]
    shrank = [a for a in actions if a["to"] < a["from"]]
    assert grew and all(120 <= a["t"] <= 280 for a in grew), actions  # only while the load is high
    assert shrank and max(a["t"] for a in shrank) > 270, actions  # and back down once it is low again
    for pool in ("prefill", "decode"):  # no pool reverses direction within two cool-downs
        acts = [a for a in actions if a["pool"] == pool]
        for a, b in zip(acts, acts[1:]):
            assert (a["to"] - a["from"]) * (b["to"] - b["from"]) > 0 or b["t"] - a["t"] >= 60, actions
    assert sim.pool_size("prefill") == 1 and sim.pool_size("decode") == 1
    assert auto["failed"] == 0
    assert auto["slo_attainment"] > static["slo_attainment"] + 0.2, (auto, static)
    assert len(scaler.history) == pytest.approx(420 / 5, abs=3)
    assert dataclasses.asdict(CONFIG)["cooldown_s"] == 30


def test_the_driver_loop_reads_the_router_and_calls_the_pool_manager():
    class Metrics:
        recent = deque()

    now = time.time()
    for i in range(10):  # slow first tokens, long queues: the prefill pool should grow
        tr = RequestTrace(f"r{i}", 100)
        tr.ttft_s, tr.e2e_s, tr.output_tokens, tr.queue_s = 5.0, 6.0, 11, 4.0
        Metrics.recent.append((now, tr))

    class Backend:
        def workers(self):
            return [
                WorkerInfo("prefill-0", "prefill", running=1, queued_prefill_tokens=900),
                WorkerInfo("decode-0", "decode", running=4),
            ]

    signals = RouterSignals(Metrics(), Backend(), lambda: (1, 1), window_s=20)
    s = signals()
    assert s.ttft_p90_s == pytest.approx(5.0) and s.tpot_p90_s == pytest.approx(0.1) and s.queue_p90_s == 4.0
    assert s.queued_prefill_tokens == 900 and s.prefill_busy_fraction == 1.0
    calls = []

    async def scale(p, d):
        calls.append((p, d))

    async def run():
        loop = AutoscalerLoop(dataclasses.replace(CONFIG, interval_s=0.01), signals, scale)
        loop.start()
        await asyncio.sleep(0.1)
        loop.stop()
        return loop

    loop = asyncio.run(run())
    assert calls and calls[0] == (2, 1)  # grew prefill once, then the cool-down held it
    assert len(calls) == 1 and loop.actions[0]["to"] == [2, 1]


def test_baton_serve_runs_the_loop_inside_the_apps_lifespan():
    app = FastAPI()
    app.state.baton = SimpleNamespace(metrics=SimpleNamespace(recent=[]))
    pools = SimpleNamespace(targets=SimpleNamespace(prefill=1, decode=1))
    backend = SimpleNamespace(workers=lambda: [])
    loop = install_autoscaler(app, pools, backend, dataclasses.replace(CONFIG, interval_s=0.01))

    async def run():
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.05)
            assert loop._task is not None and not loop._task.done()
        return loop._task

    task = asyncio.run(run())
    assert task.cancelled() or task.done()
    assert len(loop.autoscaler.history) >= 2


def test_a_pool_that_grew_shrinks_no_sooner_than_two_cool_downs_later():
    a = Autoscaler(CONFIG)  # cool-down 30 s, down_after 3 checks
    assert a.decide(signals(0, tpot=0.3)).decode_workers == 2  # TPOT over the SLO: one more
    shrinks = [t for t in range(30, 90, 5) if a.decide(signals(t, d=2, tpot=0.01)).decode_workers == 1]
    assert shrinks == [60]  # low since 30 s (the cool-down), but held until 2 x 30 s after growing
