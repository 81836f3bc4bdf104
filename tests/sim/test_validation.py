"""The short version of bench/sim_validate.py: re-simulate the three validation workloads with the
stored profile of this machine and compare them with the stored real `baton serve` run. A few
seconds; the real run is `python -m bench.sim_validate`.

What holds in the stored run, and is asserted: every number within 20%, and the re-simulation
reproduces the stored numbers exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.sim.validation import VALIDATION_WORKLOADS, compare, simulate

ROOT = Path(__file__).resolve().parents[2]

STORED = ROOT / "bench/results/sim_validate.json"


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
    assert all(row["within"] for row in rows.values()), rows
    # Deterministic: the same numbers, and so the same comparison, as the stored run reported.
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            assert sim[metric][q] == pytest.approx(entry["sim"][metric][q], rel=1e-6)
    assert {r["metric"]: r["within"] for r in entry["comparison"]} == {m: r["within"] for m, r in rows.items()}
