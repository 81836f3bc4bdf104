"""Workers that share one CPU host slow each other's steps: `HostContention` says how much, and
`SharedHost` times the steps of the workers on one host with it.

A CPU deployment on one machine (`baton serve` with a prefill and a decode worker on two cores)
gives each worker's engine thread a core of its own, but not a machine of its own. While the other
worker computes, this one's step takes longer, for two measured reasons
(`bench/profile_costs.py --served` fits both from a real server's step logs, where each step's
start and end are known on one clock):

- `busy`: a share of the step, added whenever the other worker is computing at all. The router,
  the client and Ray's threads then find no idle core and take their CPU time from the workers'.
- `per_step_rate`: a share per step per second the other worker runs. Every step streams the
  model's weights from memory once (they do not fit in the caches), so a neighbour decoding small
  batches, twenty or thirty steps a second, draws the most memory bandwidth and slows this step
  most; a neighbour in a long prefill chunk, under two steps a second, hardly.

A step of t seconds alone (the cost model's figure) runs at rate 1 / (1 + s), where
s = Σ over the other workers computing now of (busy + per_step_rate / t_other), t_other being
their own steps' alone times. The rate changes whenever a worker on the host starts or ends a
step, so a step's end is recomputed then (a fluid model: what the step had left at the old rate
goes on at the new one).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.sim.events import EventLoop
from cluster.sim.fitted_costs import FittedCostModel, fit_cost_model
from cluster.sim.step_shape import StepShape
from common.stats import percentile

__all__ = ["HostContention", "SharedHost", "fit_host_contention", "load_host_contention", "overlap_features"]


@dataclass(frozen=True)
class HostContention:
    """How much a step slows while another worker on the host computes (see the module docstring)."""

    busy: float = 0.0
    per_step_rate: float = 0.0  # seconds: share of the step per (1 / the other's step seconds)

    def __post_init__(self) -> None:
        if not (self.busy >= 0 and self.per_step_rate >= 0):
            raise ValueError(f"host contention must be >= 0, got {self}")

    def slowdown(self, other_step_s: float) -> float:
        """The share a step loses while one other worker runs a step of `other_step_s` alone."""
        return self.busy + self.per_step_rate / max(other_step_s, 1e-6)


def load_host_contention(path: str | Path) -> HostContention | None:
    """The profile's `host_contention` (bench/profile_costs.py --served), or None if it has none."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model profile {str(path)!r}: {exc}") from None
    spec = data.get("host_contention")
    return None if spec is None else HostContention(**spec)


@dataclass
class _Step:
    alone_s: float  # what the step takes with the host to itself
    done_s: float  # of alone_s, done by `since`
    rate: float  # alone seconds per second now
    since: float
    version: int  # of the end event scheduled (unique on the host); any other is stale
    on_end: Callable[..., None]
    args: tuple


class SharedHost:
    """The steps in flight on one host, each ending when its alone time is done at the rates the
    others' steps leave it."""

    def __init__(self, loop: EventLoop, contention: HostContention) -> None:
        self.loop = loop
        self.contention = contention
        self._steps: dict[object, _Step] = {}
        self._versions = 0  # end events scheduled so far: a step's stale ones never match a later step's

    def run(self, worker: object, alone_s: float, on_end: Callable[..., None], *args) -> None:
        """Start `worker`'s step of `alone_s`; `on_end(*args)` runs when it is done."""
        if worker in self._steps:
            raise ValueError(f"{worker!r} is already running a step on this host")
        self._advance()
        self._steps[worker] = _Step(alone_s, 0.0, 1.0, self.loop.now, 0, on_end, args)
        self._rerate()

    def cancel(self, worker: object) -> None:
        """The worker is gone mid-step (killed): its step neither ends nor slows the others."""
        if self._steps.pop(worker, None) is not None:
            self._advance()
            self._rerate()

    def _advance(self) -> None:
        now = self.loop.now
        for step in self._steps.values():
            step.done_s += (now - step.since) * step.rate
            step.since = now

    def _rerate(self) -> None:
        steps = self._steps
        for worker, step in steps.items():
            s = sum(self.contention.slowdown(o.alone_s) for w, o in steps.items() if w is not worker)
            rate = 1.0 / (1.0 + s)
            if rate == step.rate and step.version:
                continue  # its end event stands
            step.rate = rate
            self._versions += 1
            step.version = self._versions
            left = max(0.0, step.alone_s - step.done_s)
            self.loop.after(left / rate, self._end, worker, step.version)

    def _end(self, worker: object, version: int) -> None:
        step = self._steps.get(worker)
        if step is None or step.version != version:
            return  # rescheduled since, or cancelled
        del self._steps[worker]
        self._advance()
        self._rerate()
        step.on_end(*step.args)


def overlap_features(samples: list[dict], alone_s: list[float]) -> list[tuple[float, float]]:
    """Per step of `samples` (each with its `worker`, `end` on one clock and `seconds`): the share of
    it during which another worker of the host computed, and the other workers' steps per second
    over it, each counted by its alone time `alone_s` (the features of HostContention's fit)."""
    by_worker: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_worker.setdefault(s["worker"], []).append(i)
    for ids in by_worker.values():
        ids.sort(key=lambda i: samples[i]["end"])
    ends = {w: [samples[i]["end"] for i in ids] for w, ids in by_worker.items()}
    out = []
    for s in samples:
        start, end = s["end"] - s["seconds"], s["end"]
        busy = rate = 0.0
        for w, ids in by_worker.items():
            if w == s["worker"]:
                continue
            k = bisect.bisect_right(ends[w], start)  # a worker's steps do not overlap: ends sorted as starts
            while k < len(ids):
                o = samples[ids[k]]
                o_start = o["end"] - o["seconds"]
                if o_start >= end:
                    break
                overlap = min(end, o["end"]) - max(start, o_start)
                busy += overlap
                rate += overlap / max(alone_s[ids[k]], 1e-6)
                k += 1
        span = max(end - start, 1e-9)
        out.append((busy / span, rate / span))
    return out


def fit_host_contention(samples: list[dict], rounds: int = 10) -> tuple[dict[str, float], float, dict, HostContention]:
    """fit_cost_model's coefficients for a step alone, and the HostContention of the host the
    samples' workers shared, fitted together: step = alone(shape) · (1 + busy · f + per_step_rate · r)
    with (f, r) = overlap_features, by alternating least squares on relative error (each half
    keeps its coefficients >= 0)."""
    t = np.array([s["seconds"] for s in samples])
    shapes = [StepShape(**{k: s[k] for k in StepShape.__dataclass_fields__}) for s in samples]
    coefficients, knee, _ = fit_cost_model(samples)
    kappa = np.zeros(2)
    for _ in range(rounds):
        model = FittedCostModel(coefficients, knee, 1, 1)
        alone = np.array([model.step_time(sh) for sh in shapes])
        x = np.array(overlap_features(samples, alone.tolist()))
        # (alone · (1 + κ·x) − t) / t, linear in κ
        design, target = (alone / t)[:, None] * x, 1.0 - alone / t
        active = [0, 1]
        while active:
            coef, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
            if (coef >= 0).all():
                break
            active.pop(int(np.argmin(coef)))
        kappa = np.zeros(2)
        if active:
            kappa[active] = coef
        stretched = 1.0 + x @ kappa
        coefficients, knee, _ = fit_cost_model([dict(s, seconds=s["seconds"] / k) for s, k in zip(samples, stretched)])
    model = FittedCostModel(coefficients, knee, 1, 1)
    alone = np.array([model.step_time(sh) for sh in shapes])
    x = np.array(overlap_features(samples, alone.tolist()))
    rel = np.abs(alone * (1.0 + x @ kappa) - t) / t
    quality = {
        "rms_relative_error": float(np.sqrt(np.mean(rel**2))),
        "median_relative_error": float(np.median(rel)),
        "p90_relative_error": percentile(rel.tolist(), 90),
        "samples": len(samples),
        "rms_relative_error_alone_model": float(np.sqrt(np.mean(((alone - t) / t) ** 2))),
    }
    return coefficients, knee, quality, HostContention(float(kappa[0]), float(kappa[1]))
