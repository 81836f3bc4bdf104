"""The busy-host condition of the benchmarks: a CPU hog's duty loop (bench/cpu_hog.py runs it as a
process) and the host's CPU-time fractions over a run (steal, busy), read off /proc/stat, and
which CPU the host has.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

from common.host_cpu import busy_ticks, cpu_times

__all__ = ["HogReport", "cpu_fractions", "cpu_name", "cpu_times", "run_hog"]


@dataclass(frozen=True)
class HogReport:
    wall_s: float
    busy_s: float
    duty_asked: float
    duty_achieved: float
    periods: int


def run_hog(duty: float, period_s: float, seconds: float, stop=lambda: False) -> HogReport:
    """Spin `duty` of every `period_s` and sleep the rest, until `seconds` pass or `stop()`."""
    if not 0.0 < duty <= 1.0:
        raise ValueError(f"duty must be in (0, 1], got {duty}")
    if period_s <= 0 or seconds <= 0:
        raise ValueError(f"period and seconds must be positive, got {period_s} and {seconds}")
    start = time.monotonic()
    busy = 0.0
    periods = 0
    while not stop():
        period_start = time.monotonic()
        if period_start - start >= seconds:
            break
        spin_until = period_start + duty * period_s
        x = 0
        while time.monotonic() < spin_until:
            x += 1  # pure-Python work: holds the GIL and one core, allocates nothing
        busy += time.monotonic() - period_start
        periods += 1
        rest = period_start + period_s - time.monotonic()
        if rest > 0:
            time.sleep(rest)
    wall = time.monotonic() - start
    return HogReport(round(wall, 3), round(busy, 3), duty, round(busy / wall, 3) if wall else 0.0, periods)


def cpu_fractions(before: list[int], after: list[int]) -> dict[str, float | None]:
    """Steal (time the hypervisor gave to other guests) and busy (neither idle nor iowait) over the
    interval, as fractions of all CPU time."""
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])
    if len(before) < 8 or len(after) < 8 or total <= 0:  # no /proc/stat, or no tick in between
        return {"cpu_steal": None, "cpu_busy": None}
    return {"cpu_steal": round(delta[7] / total, 4), "cpu_busy": round(busy_ticks(delta) / total, 4)}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
