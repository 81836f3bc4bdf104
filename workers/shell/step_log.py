"""A worker's step log: each engine step's shape and wall time appended as a JSON line to
`<BATON_STEP_LOG_DIR>/<worker id>.jsonl`, when that variable names a folder.

bench/profile_costs.py --served fits the simulator's cost model to a real server's steps from these
files, and tests/e2e/test_streams_beside_a_long_prompt.py lays two workers' steps side by side.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Protocol

import torch

from common import envs
from common.roles import Role

__all__ = ["STEP_LOG_ENV", "StepLog"]

STEP_LOG_ENV = envs.BATON_STEP_LOG_DIR.name

StepObserver = Callable[[list[tuple[int, int, bool]], float], None]  # workers.engine.llm_engine's


class Observable(Protocol):
    def observe_steps(self, observer: StepObserver) -> Callable[[], None]:
        """Call `observer` after every step; returns what stops it."""
        ...


class StepLog:
    """Appends every step of one engine to its worker's file until closed."""

    def __init__(self, folder: str, worker_id: str, role: Role, engine: Observable) -> None:
        self.role = role
        self._file = open(os.path.join(folder, f"{worker_id}.jsonl"), "a", buffering=1)
        self._stop = engine.observe_steps(self._write)

    @classmethod
    def if_asked(cls, worker_id: str, role: Role, engine: Observable) -> StepLog | None:
        """A step log when $BATON_STEP_LOG_DIR names a folder, else None (the engine is not asked)."""
        folder = envs.step_log_dir()
        return cls(folder, worker_id, role, engine) if folder else None

    def _write(self, chunks: list[tuple[int, int, bool]], seconds: float) -> None:
        if self._file.closed:  # an engine thread that outlived its worker's shutdown logs nothing more
            return
        # `end` on the monotonic clock, which every process of the host shares: steps of two
        # workers can be laid side by side.
        line = {
            "role": self.role,
            "seconds": seconds,
            "end": time.monotonic(),
            "threads": torch.get_num_threads(),
            "chunks": chunks,
        }
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._stop()
        self._file.close()
