"""Workers sharing a CPU host (cluster.sim.host): the fluid model's step ends, worked out by hand,
and the fit of its coefficients from two workers' logged steps."""

from __future__ import annotations

import random

import pytest

from cluster.sim.costs import FittedCostModel, StepShape
from cluster.sim.events import EventLoop
from cluster.sim.host import HostContention, SharedHost, fit_host_contention, overlap_features


def ends(contention: HostContention, steps: list[tuple[str, float, float]]) -> dict[str, float]:
    """Run (worker, start, alone seconds) on one SharedHost; when each step ended."""
    loop, out = EventLoop(), {}
    host = SharedHost(loop, contention)
    for worker, start, alone in steps:
        loop.at(start, host.run, worker, alone, lambda w=worker: out.__setitem__(w, loop.now))
    loop.run()
    return out


def test_a_step_slows_while_the_other_worker_computes():
    # busy 0.5: A (1 s alone) runs alone 0-0.5 s (half done); B (1 s) starts, both at 1 / 1.5.
    # A's other half takes 0.75 s: ends at 1.25 s. B did 0.75 / 1.5 = 0.5 s of its work by then,
    # and the other half alone: ends at 1.75 s.
    got = ends(HostContention(busy=0.5), [("A", 0.0, 1.0), ("B", 0.5, 1.0)])
    assert got == pytest.approx({"A": 1.25, "B": 1.75})


def test_a_fast_stepping_neighbour_slows_a_step_more_than_a_slow_one():
    # per_step_rate 0.1 s: beside B's 0.2 s steps, A loses 0.1 / 0.2 = 0.5 (rate 1 / 1.5); beside
    # A's 1 s step, B loses 0.1 (rate 1 / 1.1). Both start at 0: B ends at 0.22 s, having slowed A
    # to 0.22 / 1.5 = 0.14667 s of work; A's remaining 0.85333 s alone end it at 1.07333 s.
    got = ends(HostContention(per_step_rate=0.1), [("A", 0.0, 1.0), ("B", 0.0, 0.2)])
    assert got == pytest.approx({"A": 0.22 + (1 - 0.22 / 1.5), "B": 0.22})


def test_without_contention_a_step_takes_its_alone_time():
    assert ends(HostContention(), [("A", 0.0, 1.0), ("B", 0.3, 0.5)]) == pytest.approx({"A": 1.0, "B": 0.8})


def test_a_cancelled_step_stops_slowing_the_other():
    loop, out = EventLoop(), {}
    host = SharedHost(loop, HostContention(busy=1.0))
    host.run("A", 1.0, lambda: out.__setitem__("A", loop.now))
    host.run("B", 1.0, lambda: out.__setitem__("B", loop.now))
    loop.at(0.5, host.cancel, "B")  # A did 0.25 s by then, the rest alone
    loop.run()
    assert out == pytest.approx({"A": 1.25})


def test_overlap_features_count_the_others_busy_share_and_step_rate():
    samples = [
        {"worker": "p", "end": 1.0, "seconds": 1.0},  # 0-1
        {"worker": "d", "end": 0.5, "seconds": 0.25},  # 0.25-0.5
        {"worker": "d", "end": 0.75, "seconds": 0.25},  # 0.5-0.75
    ]
    got = overlap_features(samples, [1.0, 0.25, 0.25])
    # p: busy 0.5 of its 1 s, two 0.25 s steps over it (2 per second); each d step: p all along, at 1 per second.
    assert [x for pair in got for x in pair] == pytest.approx([0.5, 2.0, 1.0, 1.0, 1.0, 1.0])


def test_the_fit_recovers_a_known_model_and_contention():
    truth = {
        "c0": 0.01,
        "c_token": 0.002,
        "c_sampled": 0.0,
        "c_decode_ctx": 0.0,
        "c_prefill_pairs": 0.0,
        "c_decode_seq": 0.0,
    }
    model, contention = FittedCostModel(truth, 1, 1, 1), HostContention(busy=0.1, per_step_rate=0.005)
    loop, rng, samples = EventLoop(), random.Random(0), []
    host = SharedHost(loop, contention)

    def step(worker: str, left: int) -> None:
        # a prefill worker's long chunks now and then, a decode worker's short steps, with idle gaps
        tokens = rng.choice((64, 128, 256)) if worker == "p" else rng.randrange(1, 17)
        shape, began = StepShape(tokens=tokens, sampled=1), loop.now

        def done() -> None:
            samples.append({"worker": worker, "end": loop.now, "seconds": loop.now - began, **shape.__dict__})
            if left:
                loop.after(rng.choice((0.0, 0.0, 0.3)), step, worker, left - 1)

        host.run(worker, model.step_time(shape), done)

    step("p", 120)
    step("d", 600)
    loop.run()
    coefficients, knee, quality, fitted = fit_host_contention(samples)
    assert coefficients["c_token"] == pytest.approx(0.002, rel=0.05)
    assert fitted.busy == pytest.approx(0.1, abs=0.03)
    assert fitted.per_step_rate == pytest.approx(0.005, rel=0.3)
    assert quality["rms_relative_error"] < quality["rms_relative_error_alone_model"]
