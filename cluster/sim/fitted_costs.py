"""Cost models measured on real hosts: `FittedCostModel`, whose coefficients `fit_cost_model` fits
(least squares over engine steps that bench/profile_costs.py timed on this machine, with a floor
below which a step costs as much as `knee` tokens: streaming the weights once), and
`TensorParallelCost`, a worker of several ranks on hosts measured at one rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.sim.step_shape import CostModel, StepShape
from common.stats import percentile

__all__ = ["FittedCostModel", "TensorParallelCost", "fit_cost_model"]


class FittedCostModel:
    """step = c0 + c_token * max(tokens, knee) + c_sampled * sampled + c_decode_ctx * decode_context
    + c_prefill_pairs * prefill_pairs + c_decode_seq * decode_seqs, coefficients from profiling."""

    COEFFICIENTS = ("c0", "c_token", "c_sampled", "c_decode_ctx", "c_prefill_pairs", "c_decode_seq")

    def __init__(
        self,
        coefficients: dict[str, float],
        knee: float,
        kv_bytes_per_token: int,
        kv_capacity_tokens: int,
        gpus_per_worker: int = 1,
    ) -> None:
        missing = [c for c in self.COEFFICIENTS if c not in coefficients]
        if missing:
            raise ValueError(f"fitted cost model lacks coefficients {missing}")
        if knee < 1 or kv_bytes_per_token < 1 or kv_capacity_tokens < 1:
            raise ValueError("knee, kv_bytes_per_token and kv_capacity_tokens must be >= 1")
        self.coefficients = {k: float(coefficients[k]) for k in self.COEFFICIENTS}
        self.knee = float(knee)
        self._kv_bytes = int(kv_bytes_per_token)
        self._kv_tokens = int(kv_capacity_tokens)
        self._gpus = gpus_per_worker
        c = self.coefficients
        self._c = (c["c0"], c["c_token"], c["c_sampled"], c["c_decode_ctx"], c["c_prefill_pairs"], c["c_decode_seq"])

    @staticmethod
    def features(shape: StepShape, knee: float) -> list[float]:
        return [
            1.0,
            max(float(shape.tokens), knee),
            float(shape.sampled),
            float(shape.decode_context),
            float(shape.prefill_pairs),
            float(shape.decode_seqs),
        ]

    def step_time(self, shape: StepShape) -> float:
        c0, ct, cs, cd, cp, cq = self._c
        return (
            c0
            + ct * max(shape.tokens, self.knee)
            + cs * shape.sampled
            + cd * shape.decode_context
            + cp * shape.prefill_pairs
            + cq * shape.decode_seqs
        )

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    def kv_capacity_tokens(self) -> int:
        return self._kv_tokens

    def gpus_per_worker(self) -> int:
        return self._gpus

    def to_dict(self) -> dict:
        return {
            "kind": "fitted",
            "coefficients": self.coefficients,
            "knee": self.knee,
            "kv_bytes_per_token": self._kv_bytes,
            "kv_capacity_tokens": self._kv_tokens,
            "gpus_per_worker": self._gpus,
        }


@dataclass(frozen=True)
class TensorParallelCost:
    """A worker of `tp` ranks on hosts measured at one rank (`base`, e.g. a FittedCostModel of this
    CPU): rank 0's step is base's with the sharded layers' share of it divided by tp (the embedding,
    lm_head and sampling stay whole on rank 0), plus 2 all-reduces per layer and the step's
    broadcast, both as measured on the host (bench/tp.py times them between rank processes, an
    all-reduce between compute of one layer's share, since a rank that is still computing is what
    the other waits for)."""

    base: CostModel
    tp: int
    layers: int
    sharded_fraction: float  # of base's step in the sharded layers (ModelShape.sharded_weight_fraction)
    allreduce_s: float
    broadcast_s: float

    def __post_init__(self) -> None:
        if self.tp < 1 or self.layers < 1 or not 0 <= self.sharded_fraction <= 1:
            raise ValueError(f"need tp >= 1, layers >= 1 and 0 <= sharded_fraction <= 1, got {self}")

    def step_time(self, shape: StepShape) -> float:
        base = self.base.step_time(shape)
        if self.tp == 1:
            return base
        share = self.sharded_fraction / self.tp + 1.0 - self.sharded_fraction
        return base * share + 2 * self.layers * self.allreduce_s + self.broadcast_s

    def kv_bytes_per_token(self) -> int:
        return self.base.kv_bytes_per_token()

    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens()

    def gpus_per_worker(self) -> int:
        return self.base.gpus_per_worker() * self.tp


def fit_cost_model(samples: list[dict]) -> tuple[dict[str, float], float, dict]:
    """Least squares on relative error (each step weighs the same whatever its length), coefficients >= 0."""
    names = FittedCostModel.COEFFICIENTS
    t = np.array([s["seconds"] for s in samples])
    shapes = [StepShape(**{k: s[k] for k in StepShape.__dataclass_fields__}) for s in samples]
    best: tuple[np.ndarray, int, float, np.ndarray] | None = None
    for knee in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        x = np.array([FittedCostModel.features(sh, knee) for sh in shapes]) / t[:, None]
        active = list(range(len(names)))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active], np.ones(len(t)), rcond=None)
            negative = [a for a, c in zip(active, coef) if c < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda a: coef[active.index(a)]))
        full = np.zeros(len(names))
        full[active] = coef
        pred = np.array([FittedCostModel.features(sh, knee) for sh in shapes]) @ full
        err = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
        if best is None or err < best[2]:
            best = (full, knee, err, pred)
    assert best is not None  # the first knee sets it
    full, knee, err, pred = best
    rel = np.abs(pred - t) / t
    quality = {
        "rms_relative_error": err,
        "median_relative_error": float(np.median(rel)),
        "p90_relative_error": percentile(rel.tolist(), 90),
        "samples": len(samples),
    }
    return dict(zip(names, map(float, full))), float(knee), quality
