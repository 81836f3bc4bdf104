"""The short version of bench/sim_validate.py: re-simulate the three validation workloads with the
stored profile of this machine and check them against the stored real `baton serve` run (TTFT
p50/p99 and TPOT p50 within 20%). A few seconds; the real run is `python bench/sim_validate.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cluster.sim.validation import VALIDATION_WORKLOADS, compare

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import sim_validate  # noqa: E402  (bench/sim_validate.py: the same simulation it reports)

STORED = ROOT / "bench/results/sim_validate.json"


@pytest.fixture(scope="module")
def stored() -> dict:
    if not STORED.is_file():
        pytest.skip("no stored validation run (python bench/sim_validate.py writes it)")
    return json.loads(STORED.read_text())


@pytest.mark.parametrize("workload", VALIDATION_WORKLOADS)
def test_the_simulator_matches_the_stored_real_run_within_20_percent(stored, workload):
    entry = stored["results"][workload]
    sim = sim_validate.simulate(workload, ROOT / stored["profile"])
    rows = compare(entry["real"], sim)
    for row in rows:
        assert row["within"], (workload, rows)
    # And the simulation is deterministic: the same numbers the stored run reported.
    for metric in ("ttft_ms", "tpot_ms"):
        assert sim[metric]["p50"] == pytest.approx(entry["sim"][metric]["p50"], rel=1e-6)
