"""A cost model of a worker like this machine's (bench/results/cost_profile_cpu.json, rounded), for
the planner's, the autoscaler's and the LoRA simulations' tests, and the model profile file
`baton plan` reads it from."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.sim.fitted_costs import FittedCostModel

MACHINE_COST = FittedCostModel(
    {
        "c0": 0.012,
        "c_token": 0.0011,
        "c_sampled": 0.0004,
        "c_decode_ctx": 2e-6,
        "c_prefill_pairs": 4e-8,
        "c_decode_seq": 0.0003,
    },
    knee=8,
    kv_bytes_per_token=46080,
    kv_capacity_tokens=23296,
)


def write_profile(path: Path, cost: FittedCostModel = MACHINE_COST) -> Path:
    """A model profile (bench/profile_costs.py's format) of `cost`, with a 1 s heartbeat and the
    cpu-shm link, at `path`."""
    fitted = {k: v for k, v in cost.to_dict().items() if k != "kind"}
    profile = {"cost_model": {"kind": "fitted", **fitted}, "overheads": {"heartbeat_s": 1.0}, "link": "cpu-shm"}
    path.write_text(json.dumps(profile))
    return path
