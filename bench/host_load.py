"""How busy the rest of the host is while a benchmark measures: wait for a quiet machine before a
real measurement, and account for the CPU time others took during it.

A real run on this 2-core machine is only worth comparing with a model of it when nothing else
competes for the cores: `wait_for_quiet` polls the 1-minute load average until it has stayed
below a threshold for a while (or gives up after a limit, saying so), and `CpuWatch` measures, over
one run, the cores the processes outside the benchmark's own (the client, this process, and the
server's process tree) kept busy: the host's busy CPU time (/proc/stat) less the tree's
(/proc/PID/stat of each process in it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.host_cpu import busy_ticks, cpu_times, ticks_per_second

__all__ = ["CpuWatch", "load_average", "wait_for_quiet"]


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def wait_for_quiet(
    below: float = 0.6,
    hold_s: float = 60.0,
    poll_s: float = 30.0,
    limit_s: float = 3600.0,
    log: Callable[[str], None] = print,
) -> dict:
    """Wait until the 1-minute load average has read below `below` at every poll for `hold_s`
    (polled every `poll_s`), or `limit_s` has passed. Returns {quiet, waited_s, load_average_1m}."""
    started = time.monotonic()
    quiet_since: float | None = None
    while True:
        now, load = time.monotonic(), load_average()
        if load < below:
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= hold_s:
                return {"quiet": True, "waited_s": round(now - started, 1), "load_average_1m": load}
        else:
            quiet_since = None
        if now - started >= limit_s:
            log(f"the host never stayed quiet (1-minute load {load:.2f}) within {limit_s:.0f} s; measuring anyway")
            return {"quiet": False, "waited_s": round(now - started, 1), "load_average_1m": load}
        log(f"waiting for a quiet host: 1-minute load {load:.2f} (need < {below} for {hold_s:.0f} s)")
        time.sleep(poll_s)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, user + system ticks) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _tree_ticks(roots: list[int]) -> dict[int, int]:
    """CPU ticks of every process in the trees under `roots` (the roots included)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            s = _stat(int(entry))
            if s is not None:
                stats[int(entry)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [r for r in roots if r in stats]
    while todo:
        pid = todo.pop()
        out[pid] = stats[pid][1]
        todo.extend(children.get(pid, ()))
    return out


@dataclass
class CpuWatch:
    """Over one run: the host's busy cores and the part of them outside `roots`' process trees."""

    roots: list[int]
    _start: tuple[float, int, dict[int, int], float] | None = field(default=None, init=False)

    def start(self) -> None:
        self._start = (time.monotonic(), busy_ticks(cpu_times()), _tree_ticks(self.roots), load_average())

    def stop(self) -> dict:
        """{wall_s, host_busy_cores, others_cores, load_average_1m_start, load_average_1m_end}."""
        assert self._start is not None, "CpuWatch.stop before start"
        t0, busy0, tree0, load0 = self._start
        wall = time.monotonic() - t0
        tree1 = _tree_ticks(self.roots)
        hz = ticks_per_second()
        host = (busy_ticks(cpu_times()) - busy0) / hz
        tree = sum(t - tree0.get(pid, 0) for pid, t in tree1.items()) / hz
        return {
            "wall_s": round(wall, 1),
            "host_busy_cores": round(host / wall, 3),
            "others_cores": round(max(0.0, host - tree) / wall, 3),
            "load_average_1m_start": round(load0, 2),
            "load_average_1m_end": round(load_average(), 2),
        }
