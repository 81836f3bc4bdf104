"""The AOT compile check (test_compile_targets.py) started in the background when the session is
collected (tests/kernels/conftest.py), and where the test finds it: a module of its own because
pytest imports test modules under their bare names, and the stash key must be one object."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

BACKGROUND_TIMEOUT_S = 1800  # from collection on: the tests before the check may keep both cores busy


@dataclass
class BackgroundCompiles:
    jobs: list[dict]
    results: Future
    processes: list = field(default_factory=list)  # the compile subprocesses, as they start

    def stop(self) -> None:
        for proc in self.processes:
            proc.kill()


COMPILES = pytest.StashKey[BackgroundCompiles]()


def start_in_background(jobs: list[dict], run_compiles: Callable[..., list[dict]]) -> BackgroundCompiles:
    """`run_compiles(jobs)` with its subprocesses at the lowest priority, fed from a thread of its own."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="aot-compile-check")
    processes: list = []
    future = executor.submit(run_compiles, jobs, None, BACKGROUND_TIMEOUT_S, True, processes)
    executor.shutdown(wait=False)
    return BackgroundCompiles(jobs, future, processes)
