"""The host's aggregate CPU time counters, read off /proc/stat (the benchmarks' busy-host
fractions and a decode worker's borrowing of idle cores both read them)."""

from __future__ import annotations

import os


def cpu_times(stat_path: str = "/proc/stat") -> list[int]:
    """/proc/stat's cpu line, in clock ticks: user, nice, system, idle, iowait, irq, softirq,
    steal, ...; empty where there is no /proc."""
    try:
        with open(stat_path) as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return []


def busy_ticks(times: list[int]) -> int:
    """Of `cpu_times()`, the ticks that were neither idle nor iowait (steal included: a core the
    hypervisor gave to someone else was not free either)."""
    return sum(times[:8]) - times[3] - times[4]


def ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")
