"""The busy-host condition's pieces (cluster.busy_host): the CPU hog's bounds and the CPU-time fractions of a run."""

from __future__ import annotations

import pytest

from cluster.busy_host import cpu_fractions, run_hog


def test_cpu_fractions_are_read_off_proc_stat_counters():
    # user nice system idle iowait irq softirq steal (guest fields after are not added again)
    before = [100, 0, 50, 800, 50, 0, 0, 0, 0, 0]
    after = [160, 0, 70, 860, 60, 0, 0, 50, 0, 0]  # 60 + 20 busy, 60 idle, 10 iowait, 50 steal of 200
    assert cpu_fractions(before, after) == {"cpu_steal": 0.25, "cpu_busy": 0.65}
    assert cpu_fractions([], after) == {"cpu_steal": None, "cpu_busy": None}
    assert cpu_fractions(after, after) == {"cpu_steal": None, "cpu_busy": None}  # no tick: no fraction


def test_the_hog_stops_when_told_and_refuses_a_duty_it_cannot_have():
    report = run_hog(0.5, 0.01, 60.0, stop=lambda: True)
    assert report.periods == 0 and report.busy_s == 0.0
    calls = iter([False, False, True])
    report = run_hog(1.0, 0.001, 60.0, stop=lambda: next(calls))
    assert report.periods == 2 and 0 < report.busy_s <= report.wall_s
    for duty in (0.0, 1.5):
        with pytest.raises(ValueError, match="duty"):
            run_hog(duty, 0.01, 1.0)
