"""A CPU decode worker runs its next step on the host's idle cores too.

Decode on a CPU streams every weight and the batch's KV once per step, so a step is bound by how
fast the cores that run it can read memory, and one core cannot draw a socket's bandwidth
(`bench/decode_profile.py`: a float32 step of 16 sequences on one core of the 2-core Intel host
takes about 1.7x as long as on two). The cores are split between the workers so that a long
prompt's prefill never takes the decode worker's share (`cluster.placement`), but most of the time
the prefill worker has nothing to do and its core sits idle.

`ElasticThreads` decides, before each decode step, how many threads the step may use: the
worker's own share always, and every further core that the other processes on the host left
idle over the last window (at least `WINDOW_S`): the host's busy CPU time (`/proc/stat`) less this
process's own. When a prefill starts on the core it borrowed, the next window sees it and the
decode worker gives the core back, so a prefill waits at most about one decode step for its core
and a decode step never waits on anyone but its own share. Whatever else runs on the host (a
neighbour, a log shipper) counts the same way as the prefill worker does.

Only the decode role borrows: its steps are short, so it notices within one step that a core is
wanted again; a prefill chunk can run for seconds, and a prefill worker that borrowed the decode
worker's core would hold it that long.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.roles import Role
from workers.config import WorkerConfig

# Shortest window the decision is made over: /proc/stat counts in ticks of 10 ms, so a shorter
# window would read another process's use too coarsely.
WINDOW_S = 0.1
# A core may be borrowed while the other processes keep less than this share of it busy: the
# router and a benchmark's client always take a little. It must stay below the half of a core that
# a prefill gets while it shares its core with the borrowed thread, or the core would never return.
BORROW_BELOW = 0.3


@dataclass(frozen=True)
class CpuSample:
    """CPU time in seconds since boot (all cores: busy; this process: own) at a monotonic time."""

    at: float
    host_busy_s: float
    own_s: float


def host_busy_seconds(stat_path: str = "/proc/stat") -> float:
    """Busy CPU time of every core together: user, nice, system, irq, softirq and steal (a core the
    hypervisor gave to someone else is not ours to use either)."""
    with open(stat_path) as f:
        fields = f.readline().split()
    assert fields[0] == "cpu", fields
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def sample_now() -> CpuSample:
    return CpuSample(time.monotonic(), host_busy_seconds(), time.process_time())


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


class ElasticThreads:
    """Threads for the next step: `share` at least, `most` at most (see the module docstring)."""

    def __init__(self, share: int, most: int, sample: Callable[[], CpuSample] = sample_now,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        if share < 1 or most < share:
            raise ValueError(f"elastic threads need 1 <= share ({share}) <= most ({most})")
        self.share, self.most = share, most
        self._sample, self._set_threads = sample, set_threads
        self._last = sample()
        self.threads = share
        self._set_threads(share)

    def others_cores(self, now: CpuSample) -> float:
        """Cores the other processes kept busy between the last sample and `now`."""
        wall = now.at - self._last.at
        others = (now.host_busy_s - self._last.host_busy_s) - (now.own_s - self._last.own_s)
        return max(0.0, others / wall)

    def before_step(self) -> int:
        """The thread count for the step about to run (set on torch when it changes)."""
        now = self._sample()
        if now.at - self._last.at < WINDOW_S:
            return self.threads
        free = self.most - self.others_cores(now)
        threads = min(self.most, max(self.share, math.floor(free + BORROW_BELOW)))
        self._last = now
        if threads != self.threads:
            self.threads = threads
            self._set_threads(threads)
        return threads


def elastic_threads_for(config: WorkerConfig) -> ElasticThreads | None:
    """The governor of a worker's engine thread, or None where it keeps its threads: any role but
    decode, a GPU, tensor parallelism, or no ceiling above its share (engine.max_threads)."""
    engine = config.engine
    if (config.role != Role.DECODE or engine.device != "cpu" or config.tp_size > 1
            or not engine.num_threads or not engine.max_threads):
        return None
    most = min(engine.max_threads, usable_cores())
    return ElasticThreads(engine.num_threads, most) if most > engine.num_threads else None
