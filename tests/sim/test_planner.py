"""The planner: its choice against exhaustive search, on small held-out cases, and `baton plan`."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main as baton
from cluster.plan_cli import parse_duration
from cluster.planner import (
    PlanProblem,
    ProbeResult,
    SplitEvaluations,
    capacity_estimate,
    exhaustive,
    plan,
    probe,
)
from cluster.sim import SLO, LengthDist, ServingOverheads, StepShape, WorkloadSpec
from tests.sim.machine import MACHINE_COST, write_profile

COST = MACHINE_COST
OVERHEADS = ServingOverheads(heartbeat_s=1.0)


def U(lo, hi):
    return LengthDist("uniform", low=lo, high=hi)


@pytest.mark.parametrize(
    "name,workload,slo",
    [
        ("prompt-heavy", WorkloadSpec(rate=1, prompt_len=U(768, 1536), output_len=U(8, 32), seed=21), SLO(4.0, 0.2)),
        ("decode-heavy", WorkloadSpec(rate=1, prompt_len=U(64, 256), output_len=U(96, 160), seed=22), SLO(3.0, 0.08)),
    ],
)
@pytest.mark.slow  # an exhaustive search of the splits: 5-6 s a case here
def test_the_plan_is_within_10_percent_of_exhaustive_search(name, workload, slo):
    problem = PlanProblem(
        5, workload, slo, COST, overheads=OVERHEADS, requests_per_probe=50, min_probe_s=15, rate_tolerance=0.06
    )
    # Exhaustive search reuses the splits the plan simulated (the same simulations, the same results:
    # bench/sim_planner.py runs the two apart) and simulates the rest.
    evaluations = SplitEvaluations(problem)
    chosen, best = plan(problem, evaluations), exhaustive(problem, evaluations)
    assert len(evaluations.results) == len(best.evaluated) == len(problem.splits())
    assert best.best.goodput > 0
    assert chosen.best.goodput_per_gpu >= 0.9 * best.best.goodput_per_gpu, (chosen.to_dict(), best.to_dict())
    assert chosen.simulations < best.simulations  # and it got there with fewer simulations


def test_a_probe_stops_once_it_cannot_pass_with_the_verdict_of_the_whole_run():
    wl = WorkloadSpec(rate=1, prompt_len=U(64, 256), output_len=LengthDist("fixed", 32), seed=5)
    problem = PlanProblem(3, wl, SLO(1.0, 0.2), COST, overheads=OVERHEADS, requests_per_probe=40, min_probe_s=4)
    whole = {rate: probe(problem, 1, 2, rate, stop_once_failed=False) for rate in (2.0, 2.5, 4.0)}
    # It passes with a request missing; it fails by a little (82.6%); it fails by a lot.
    assert [(r.passed, round(r.attainment, 3)) for r in whole.values()] == [
        (True, 0.978),
        (False, 0.826),
        (False, 0.348),
    ]
    for rate, full in whole.items():
        quick = probe(problem, 1, 2, rate)
        assert quick == full if full.passed else quick == ProbeResult(False, None)


def test_split_evaluations_belong_to_one_problem():
    problem = PlanProblem(3, WorkloadSpec(rate=1), SLO(1.0, 0.2), COST)
    with pytest.raises(ValueError, match="another planning problem"):
        plan(PlanProblem(4, WorkloadSpec(rate=1), SLO(1.0, 0.2), COST), SplitEvaluations(problem))


def test_the_capacity_estimate_balances_the_pools():
    wl = WorkloadSpec(rate=1, prompt_len=LengthDist("fixed", 512), output_len=LengthDist("fixed", 64))
    est = capacity_estimate(PlanProblem(10, wl, SLO(5.0, 0.2), COST))
    p = est["balanced_prefill_workers"]
    # p prefill workers and 10 - p decode workers then carry the same request rate.
    assert p * est["prefill_requests_per_s_per_worker"] == pytest.approx(
        (10 - p) * est["decode_requests_per_s_per_worker"]
    )
    # A prefill worker does a 512-token prompt in two 256-token chunks.
    two_chunks = COST.step_time(StepShape.of([(0, 256, False)])) + COST.step_time(StepShape.of([(256, 256, True)]))
    assert est["prefill_requests_per_s_per_worker"] == pytest.approx(1 / two_chunks)


def test_durations_read_like_the_issue_writes_them():
    assert parse_duration("2s") == 2.0 and parse_duration("50ms") == 0.05 and parse_duration("0.5") == 0.5


@pytest.mark.slow  # `baton plan` in a child process, with its plot: about 5 s here
def test_baton_plan_prints_a_plan_and_writes_json_and_a_plot(tmp_path, capsys):
    profile = write_profile(tmp_path / "profile.json")
    workload = tmp_path / "w.yaml"
    workload.write_text("rate: 0.5\nduration_s: 30\nprompt_len: {dist: uniform, low: 64, high: 256}\noutput_len: 32\n")
    code = baton(
        [
            "plan",
            "--gpus",
            "3",
            "--model-profile",
            str(profile),
            "--slo-ttft",
            "3s",
            "--slo-tpot",
            "200ms",
            "--workload",
            str(workload),
            "--requests-per-probe",
            "30",
            "--plot",
            str(tmp_path / "p.png"),
            "--json",
            str(tmp_path / "p.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "plan for 3 GPUs" in out and "goodput" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["plan"]["best"]["goodput"] > 0
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert (
        baton(
            [
                "plan",
                "--gpus",
                "3",
                "--model-profile",
                "roofline:B300:llama-8b",
                "--slo-ttft",
                "1s",
                "--slo-tpot",
                "50ms",
                "--workload",
                str(workload),
            ]
        )
        == 2
    )
    assert "roofline:GPU:MODEL" in capsys.readouterr().err
