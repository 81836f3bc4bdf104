"""A CPU decode worker runs its next step on the host's idle cores too.

Decode on a CPU streams every weight and the batch's KV once per step, so a step is bound by how
fast the cores that run it can read memory, and one core cannot draw a socket's bandwidth
(`bench/decode_profile.py`: a float32 step of 16 sequences on one core of the 2-core Intel host
takes about 1.9x as long as on two). The cores are split between the workers so that a long
prompt's prefill never takes the decode worker's share (`cluster.placement`), but most of the time
the prefill worker has nothing to do and its core sits idle.

`ElasticThreads` decides, before each decode step, how many threads the step may use: the
worker's own share always, and every further core that the other processes on the host left
idle over the last window (at least `WINDOW_S`): the host's busy CPU time (`/proc/stat`) less this
process's own. That alone is not enough: a decode step runs some 300 parallel sections, each of
which waits for its slowest thread, so a borrowed thread that shares its core with a prefill
stalls the whole step at every section (measured: a 94 ms step took 720 ms). So the prefill
workers of the host also say when they run (`CoreClaims`, two lock files): a prefill worker with
work holds a shared claim, waiting first for a borrowed decode step in flight to end (at most one
step), and a decode worker borrows only while no prefill worker claims, holding its own lock for
the length of the borrowed step. A neighbour's load only shows in the CPU time: a busy one keeps
the decode worker on its share, and one that starts meanwhile costs a step or two before the
next window sees it.

Only the decode role borrows: its steps are short, so a prefill waits at most one of them; a
prefill chunk can run for seconds, and a prefill worker that borrowed the decode worker's core
would hold it that long.
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.host_cpu import busy_ticks, cpu_times, ticks_per_second
from common.roles import Role
from workers.config import WorkerConfig

# Shortest window the decision is made over: /proc/stat counts in ticks of 10 ms, so a shorter
# window would read another process's use too coarsely.
WINDOW_S = 0.1
# A core may be borrowed while the other processes keep less than this share of it busy: the
# router and a benchmark's client always take a little. It must stay below the half of a core that
# a busy neighbour gets while it shares its core with the borrowed thread, or the neighbour would
# never get its core back (the host's prefill workers claim theirs through CoreClaims instead).
BORROW_BELOW = 0.3


@dataclass(frozen=True)
class CpuSample:
    """CPU time in seconds since boot (all cores: busy; this process: own) at a monotonic time."""

    at: float
    host_busy_s: float
    own_s: float


def host_busy_seconds(stat_path: str = "/proc/stat") -> float:
    """Busy CPU time of every core together (common.host_cpu.busy_ticks: steal counts as busy)."""
    times = cpu_times(stat_path)
    if len(times) < 8:
        raise OSError(f"{stat_path} has no cpu line to read the host's busy time from")
    return busy_ticks(times) / ticks_per_second()


def sample_now() -> CpuSample:
    return CpuSample(time.monotonic(), host_busy_seconds(), time.process_time())


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


class CoreClaims:
    """The host's prefill workers and decode workers agreeing on borrowed cores through two lock
    files (flock, per user in the temporary folder): `want`, which prefill workers with work hold
    shared, and `borrowed`, which a decode worker holds exclusively during a borrowed step and a
    prefill worker takes shared before it runs (so it waits out that step)."""

    def __init__(self, folder: str | None = None) -> None:
        base = os.path.join(folder or tempfile.gettempdir(), f"baton-cores-{os.getuid()}")
        self._want = os.open(base + ".want", os.O_RDWR | os.O_CREAT, 0o600)
        self._borrowed = os.open(base + ".borrowed", os.O_RDWR | os.O_CREAT, 0o600)
        self.claimed = False

    def claim(self) -> None:
        """A prefill worker is about to run: no decode step may borrow from now on (blocks until a
        borrowed step in flight has ended)."""
        if not self.claimed:
            fcntl.flock(self._want, fcntl.LOCK_SH)
            fcntl.flock(self._borrowed, fcntl.LOCK_SH)
            self.claimed = True

    def release(self) -> None:
        """The prefill worker has nothing left to run."""
        if self.claimed:
            fcntl.flock(self._borrowed, fcntl.LOCK_UN)
            fcntl.flock(self._want, fcntl.LOCK_UN)
            self.claimed = False

    def try_borrow(self) -> bool:
        """A decode worker may run its next step on borrowed cores: True unless a prefill worker
        claims (then or meanwhile); hold until `end_borrow`."""
        if not _try_lock(self._want):
            return False
        fcntl.flock(self._want, fcntl.LOCK_UN)  # `want` is only read; `borrowed` is what a prefill waits on
        return _try_lock(self._borrowed)

    def end_borrow(self) -> None:
        fcntl.flock(self._borrowed, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._want)
        os.close(self._borrowed)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class NoSharing:
    """What a worker's engine thread calls around its steps; as itself, a worker that neither
    borrows nor claims (a GPU, threads chosen by the user, no spare core)."""

    def before_step(self) -> int | None:
        """The thread count the step about to run gets, where this chooses it (None: left as it is)."""
        return None

    def after_step(self) -> None:
        pass

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


class ElasticThreads(NoSharing):
    """Threads for the next step: `share` at least, `most` at most (see the module docstring)."""

    def __init__(
        self,
        share: int,
        most: int,
        claims: CoreClaims,
        sample: Callable[[], CpuSample] = sample_now,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if share < 1 or most < share:
            raise ValueError(f"elastic threads need 1 <= share ({share}) <= most ({most})")
        self.share, self.most, self.claims = share, most, claims
        self._sample, self._set_threads = sample, set_threads
        self._last = sample()
        self.wanted = self.threads = share  # what the CPU time allows; what the step runs on
        self._borrowing = False
        self._set_threads(share)

    def others_cores(self, now: CpuSample) -> float:
        """Cores the other processes kept busy between the last sample and `now`."""
        wall = now.at - self._last.at
        others = (now.host_busy_s - self._last.host_busy_s) - (now.own_s - self._last.own_s)
        return max(0.0, others / wall)

    def before_step(self) -> int:
        """The thread count for the step about to run (set on torch when it changes); `after_step`
        must follow the step."""
        now = self._sample()
        if now.at - self._last.at >= WINDOW_S:
            free = self.most - self.others_cores(now)
            self.wanted = min(self.most, max(self.share, math.floor(free + BORROW_BELOW)))
            self._last = now
        self._borrowing = self.wanted > self.share and self.claims.try_borrow()
        threads = self.wanted if self._borrowing else self.share
        if threads != self.threads:
            self.threads = threads
            self._set_threads(threads)
        return threads

    def after_step(self) -> None:
        if self._borrowing:
            self.claims.end_borrow()
            self._borrowing = False

    def close(self) -> None:
        self.claims.close()


class PrefillClaim(NoSharing):
    """A CPU prefill worker's side: claims the host's cores while it has work (`CoreClaims`)."""

    def __init__(self, claims: CoreClaims) -> None:
        self.claims = claims

    def before_step(self) -> None:
        self.claims.claim()

    def idle(self) -> None:
        self.claims.release()

    def close(self) -> None:
        self.claims.close()


def core_sharing_for(config: WorkerConfig) -> NoSharing:
    """A worker's side of borrowing idle cores, for its engine thread: a CPU decode worker's governor
    (not with tensor parallelism), a CPU prefill worker's claim; nothing on a GPU, with
    threads_per_worker chosen by the user (engine.max_threads unset) or without a spare core."""
    engine = config.engine
    most = min(engine.max_threads or 0, usable_cores())
    if engine.device != "cpu" or not engine.num_threads or most <= engine.num_threads:
        return NoSharing()
    if config.role == Role.PREFILL:
        return PrefillClaim(CoreClaims())
    return ElasticThreads(engine.num_threads, most, CoreClaims()) if config.tp_size == 1 else NoSharing()
