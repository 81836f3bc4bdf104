"""A CPU decode worker borrows the cores other processes leave idle, and gives them back
(workers.shell.elastic_threads): hand-computed decisions on scripted CPU samples, the lock files through
which prefill workers claim their cores, and the real /proc/stat with a real busy process beside
this one."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from cluster.config import BatonConfig
from workers.config import EngineConfig, WorkerConfig
from workers.shell import elastic_threads
from workers.shell.elastic_threads import (
    CoreClaims,
    CpuSample,
    ElasticThreads,
    NoSharing,
    PrefillClaim,
    core_sharing_for,
    host_busy_seconds,
)


class Script:
    """Samples handed out in order; each is (seconds since start, host busy s, own s)."""

    def __init__(self, *samples: tuple[float, float, float]) -> None:
        self.samples = [CpuSample(*s) for s in samples]

    def __call__(self) -> CpuSample:
        return self.samples.pop(0)


@pytest.fixture
def claims(tmp_path):
    """The decode side's lock files, and a second opening of them for a prefill worker."""
    decode, prefill = CoreClaims(str(tmp_path)), CoreClaims(str(tmp_path))
    yield decode, prefill
    decode.close()
    prefill.close()


def test_it_borrows_while_the_others_leave_a_core_idle_and_gives_it_back(claims):
    set_to: list[int] = []
    # Windows of 0.2 s. Others' use = host busy - own, per second of wall time.
    governor = ElasticThreads(
        1,
        2,
        claims[0],
        Script(
            (0.0, 10.0, 5.0),
            (0.2, 10.22, 5.2),  # others 0.02 s / 0.2 s = 0.1 core: borrow the second core
            (0.25, 10.3, 5.25),  # 0.05 s after the last window: too short to judge, keep 2
            (0.4, 10.62, 5.5),  # others (0.4 - 0.3) / 0.2 = 0.5 core since 0.2 (a prefill started): back to 1
            (0.6, 10.98, 5.7),  # others (0.36 - 0.2) / 0.2 = 0.8 core: stay at 1
            (0.8, 11.2, 5.9),  # others 0.02 / 0.2 = 0.1 core: the prefill ended, borrow again
        ),
        set_to.append,
    )
    threads = []
    for _ in range(5):
        threads.append(governor.before_step())
        governor.after_step()
    assert threads == [2, 2, 1, 1, 2]
    assert set_to == [1, 2, 1, 2]  # the share at start, then only the changes


def test_a_prefill_worker_with_work_stops_any_borrowing_and_waits_out_a_borrowed_step(claims):
    decode_side, prefill_side = claims
    # The CPU time says a core is free at every window (a second apart).
    clock = iter(range(100))
    governor = ElasticThreads(1, 2, decode_side, lambda: CpuSample(float(next(clock)), 0.0, 0.0), lambda n: None)
    prefill = PrefillClaim(prefill_side)
    assert governor.before_step() == 2  # a borrowed step is running
    claimed = threading.Event()
    waiter = threading.Thread(target=lambda: (prefill.before_step(), claimed.set()))
    waiter.start()
    assert not claimed.wait(0.3), "the prefill ran beside a borrowed step"
    governor.after_step()
    assert claimed.wait(5.0), "the prefill never got its core back"
    waiter.join()
    assert governor.before_step() == 1  # the prefill claims: the next steps keep to the share
    governor.after_step()
    prefill.idle()
    assert governor.before_step() == 2  # idle again: borrowed again
    governor.after_step()


def test_on_four_cores_it_takes_what_the_others_leave(claims):
    # Others kept 1.2 cores busy: 2.8 are free, and a core counts once the others leave 0.7 of it.
    governor = ElasticThreads(1, 4, claims[0], Script((0.0, 0.0, 0.0), (1.0, 2.0, 0.8)), lambda n: None)
    assert governor.before_step() == 3
    governor.after_step()
    # Others above 3 cores: never below the worker's own share.
    governor = ElasticThreads(2, 4, claims[0], Script((0.0, 0.0, 0.0), (1.0, 3.9, 0.1)), lambda n: None)
    assert governor.before_step() == 2


def test_bad_bounds_are_refused(claims):
    with pytest.raises(ValueError, match="share"):
        ElasticThreads(3, 2, claims[0], Script((0.0, 0.0, 0.0)), lambda n: None)


def test_host_busy_seconds_reads_every_busy_column(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice, in ticks
    stat.write_text("cpu  100 20 30 5000 40 5 6 7 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    monkeypatch.setattr(elastic_threads, "ticks_per_second", lambda: 100)
    assert host_busy_seconds(str(stat)) == pytest.approx((100 + 20 + 30 + 5 + 6 + 7) / 100)


def test_cpu_workers_of_an_automatic_split_share_their_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(elastic_threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(elastic_threads.tempfile, "gettempdir", lambda: str(tmp_path))
    engine = EngineConfig(num_threads=1, max_threads=8)
    decode = core_sharing_for(WorkerConfig("d0", "decode", engine=engine))
    assert isinstance(decode, ElasticThreads) and (decode.share, decode.most) == (1, 4)  # this process's cores
    assert isinstance(core_sharing_for(WorkerConfig("p0", "prefill", engine=engine)), PrefillClaim)
    keep = [
        WorkerConfig("d0", "decode", engine=EngineConfig(num_threads=1)),  # threads_per_worker given
        WorkerConfig("d0", "decode", engine=EngineConfig(num_threads=4, max_threads=8)),  # no spare core
        WorkerConfig("d0", "decode", engine=engine, tp_size=2),
        WorkerConfig("d0", "decode", engine=EngineConfig(num_threads=1, max_threads=8, device="cuda")),
    ]
    assert all(type(core_sharing_for(config)) is NoSharing for config in keep)


def test_threads_per_worker_is_kept_and_the_automatic_split_may_borrow(monkeypatch):
    monkeypatch.setattr("cluster.config.os.cpu_count", lambda: 8)
    split = BatonConfig().worker_engine_config()  # 1 prefill + 1 decode worker on 8 cores
    assert (split.num_threads, split.max_threads) == (4, 8)
    chosen = BatonConfig.from_options(threads_per_worker=2).worker_engine_config()
    assert (chosen.num_threads, chosen.max_threads) == (2, None)


@pytest.mark.idle_host
@pytest.mark.skipif(len(elastic_threads.os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.slow  # waits on a real spinning process: about 4 s here
def test_a_real_busy_process_takes_the_borrowed_core_back(claims):
    """On this host's /proc/stat: with nothing else running the second core is borrowed; a process
    spinning beside this one makes the governor give it up; when it ends the core is borrowed again."""
    set_to: list[int] = []
    governor = ElasticThreads(1, 2, claims[0], set_threads=set_to.append)

    def settles_on(threads: int, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chosen = governor.before_step()
            governor.after_step()
            if chosen == threads:
                return True
            time.sleep(0.05)
        return False

    assert settles_on(2), "the host's second core was never idle"
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert settles_on(1), "a process spinning on the other core did not get it back"
    finally:
        hog.kill()
        hog.wait()
    assert settles_on(2)
