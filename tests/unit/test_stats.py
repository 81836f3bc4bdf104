"""common.stats.percentile against numpy.percentile (the oracle: its default, linear
interpolation between closest ranks), and the tree holds no other percentile definition, no
sys.path edits in bench/ or tests/, and no imports between bench/ and tests/ (but the load
generators, which bench/ owns and tests drive deployments with)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from common.stats import percentile, percentiles, summary

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("router", "workers", "kvtransfer", "kernels", "cluster", "common", "testkit", "bench")
# bench/'s load generators: libraries that tests use too (the benchmark scripts are not).
LOAD_GENERATORS = re.compile(
    r"^\s*from\s+bench(\.(loadgen|structured_load)\s+import|\s+import\s+(loadgen|structured_load)\b)"
)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_equals_numpy_default(n):
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 10, 25, 33.3, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)
    assert percentiles(values, (50, 99)) == [percentile(values, 50), percentile(values, 99)]


def test_percentile_edges():
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5  # interpolated, not a nearest rank
    assert percentile((x for x in [5.0]), 99) == 5.0  # any iterable
    for bad in ([], ()):
        with pytest.raises(ValueError):
            percentile(bad, 50)
    for q in (-0.1, 100.1, float("nan")):
        with pytest.raises(ValueError):
            percentile([1.0], q)
    with pytest.raises(ValueError):
        percentile([1.0, float("nan")], 50)


def test_summary_is_the_benchmarks_shape():
    assert summary([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    s = summary([0.001, 0.002, 0.003])
    assert s == pytest.approx({"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0})


def python_files(folders) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py") if ".venv" not in p.parts)


def test_no_other_percentile_definition():
    definition = re.compile(r"^\s*def\s+\w*(percentile|quantile)\w*\s*\(", re.M)
    # An index into sorted samples computed from a fraction: a percentile written by hand.
    by_hand = re.compile(r"\[\s*min\(\s*len\(\w+\)\s*-\s*1\s*,\s*int\(|np\.(percentile|quantile)\(")
    found = []
    for path in python_files(PRODUCT):
        rel = str(path.relative_to(REPO))
        if rel == "common/stats.py":
            continue
        text = path.read_text()
        for m in list(definition.finditer(text)) + list(by_hand.finditer(text)):
            found.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}")
    # bench/overload.py's bucket_quantile reads a Prometheus histogram (a bucket's bound), not samples.
    assert [f for f in found if "bucket_quantile" not in f] == []


def test_bench_and_tests_edit_no_sys_path_and_do_not_import_each_other():
    problems = []
    for folder, other in (("bench", "tests"), ("tests", "bench")):
        imports_other = re.compile(rf"^\s*(from\s+{other}(\.|\s)|import\s+{other}(\.|\s|$))", re.M)
        for path in python_files([folder]):
            rel = path.relative_to(REPO)
            text = path.read_text()
            if path.name == "test_stats.py":
                continue
            if "sys.path.insert" in text or "sys.path.append" in text:
                problems.append(f"{rel}: edits sys.path")
            lines = [m.group(0) + text[m.end() :].partition("\n")[0] for m in imports_other.finditer(text)]
            if [line for line in lines if not LOAD_GENERATORS.match(line)]:
                problems.append(f"{rel}: imports {other}")
    assert problems == []


def test_bench_scripts_are_run_as_modules():
    assert (REPO / "bench/__init__.py").is_file()
    pattern = re.compile(r"python3?\s+bench/\w+\.py")
    offenders = [
        str(p.relative_to(REPO))
        for p in [*python_files(["bench", "tests"]), *(REPO / "bench").glob("*.sh"), REPO / "Makefile"]
        if pattern.search(p.read_text())
    ]
    assert offenders == []
