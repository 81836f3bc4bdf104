"""The one percentile definition every Baton number uses: the router's /v1/status window, the
simulator's results, the live autoscaler's signals and every benchmark in bench/.

`percentile(values, q)` is linear interpolation between the closest ranks, numpy's default
(`numpy.percentile(values, q)`, method "linear"; Hyndman and Fan's type 7): sort the n values,
take rank h = (n - 1) * q / 100 and return x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]).
So p0 is the minimum, p100 the maximum, p50 of an even count the mean of the two middle values.
Pure Python: no numpy needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["percentile", "percentiles", "summary"]


def _ordered(values: Iterable[float]) -> list[float]:
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("percentile of no values")
    if any(math.isnan(v) for v in ordered):
        raise ValueError("percentile of values that include NaN")
    return ordered


def _at(ordered: Sequence[float], q: float) -> float:
    if not 0.0 <= q <= 100.0:  # also refuses NaN
        raise ValueError(f"percentile q must be within 0..100, got {q!r}")
    h = (len(ordered) - 1) * (q / 100.0)
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in 0..100) of `values` (any order), linearly interpolated between
    the closest ranks as numpy.percentile does by default. ValueError when `values` is empty,
    holds a NaN, or q is outside 0..100."""
    return _at(_ordered(values), q)


def percentiles(values: Iterable[float], qs: Iterable[float]) -> list[float]:
    """percentile(values, q) for each q in `qs`, sorting once."""
    ordered = _ordered(values)
    return [_at(ordered, q) for q in qs]


def summary(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | None]:
    """{"p50", "p90", "p99", "mean"} of `values` times `scale` (seconds to ms by default), all None
    when there are no values: the shape of every latency figure in bench/results/*.json."""
    values = list(values)
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = percentiles(values, (50, 90, 99))
    return {"p50": p50 * scale, "p90": p90 * scale, "p99": p99 * scale, "mean": math.fsum(values) / len(values) * scale}
