"""The short version of bench/sim_validate.py: re-simulate the three validation workloads with the
stored profile of this machine and compare them with the stored real `baton serve` run. A few
seconds; the real run is `python -m bench.sim_validate`.

What holds in the stored run, and is asserted: every number within 20% but the one miss named in
KNOWN_MISSES (with the ceiling it stays under and the measured reason in
bench/results/sim_validate.md), and the re-simulation reproduces the stored numbers exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.sim.validation import VALIDATION_WORKLOADS, compare, simulate

ROOT = Path(__file__).resolve().parents[2]

STORED = ROOT / "bench/results/sim_validate.json"

# (workload, metric) -> the relative error it stays under. two_shapes' TTFT p50 falls between two
# modes of a bimodal distribution (short prompts served at once, or behind a 1,024-token prefill);
# which mode the middle requests land in follows the order six simultaneous first requests reach
# the router, so it moves by more than the tolerance (bench/results/sim_validate.md).
KNOWN_MISSES = {("two_shapes", "TTFT p50"): 0.35}


@pytest.fixture(scope="module")
def stored() -> dict:
    if not STORED.is_file():
        pytest.skip("no stored validation run (python -m bench.sim_validate writes it)")
    return json.loads(STORED.read_text())


@pytest.mark.parametrize("workload", VALIDATION_WORKLOADS)
def test_the_simulation_matches_the_stored_real_run_within_20_percent(stored, workload):
    entry = stored["results"][workload]
    sim = simulate(workload, ROOT / stored["profile"])
    rows = {r["metric"]: r for r in compare(entry["real"], sim)}
    for metric, row in rows.items():
        ceiling = KNOWN_MISSES.get((workload, metric))
        if ceiling is None:
            assert row["within"], row
        else:
            assert abs(row["relative_error"]) < ceiling, row
    # Deterministic: the same numbers, and so the same comparison, as the stored run reported.
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            assert sim[metric][q] == pytest.approx(entry["sim"][metric][q], rel=1e-6)
    assert {r["metric"]: r["within"] for r in entry["comparison"]} == {m: r["within"] for m, r in rows.items()}
