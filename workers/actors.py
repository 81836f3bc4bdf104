"""Ray actor shells for the two pools. All behaviour lives in workers.worker.EngineWorker.

The shells add what only Ray knows: the node the actor landed on and that node's IP, which the
KV transport per pair of workers needs (`WorkerConfig.node_id`, `host`), and they undo Ray's
niceness (see `normal_priority`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import ray

from common.roles import Role
from workers.worker import EngineWorker, WorkerConfig


log = logging.getLogger(__name__)


def normal_priority() -> int:
    """Every thread of this process back to niceness 0; returns how many threads were raised.

    Ray starts its worker processes at niceness 15 (its `worker_niceness`), so that its own daemons
    stay responsive; for a serving worker that means any normal process on the host (a log
    shipper, a neighbour, a benchmark client) takes the worker's core first and streams stall.
    Linux keeps a niceness per thread, and Ray's call threads exist before the constructor runs,
    so each thread is set. Lowering niceness needs CAP_SYS_NICE (root in a container has it);
    without it the workers stay at Ray's niceness, with a warning that says how to avoid it."""
    raised = 0
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        tid = int(task)
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
                raised += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            log.warning("this worker runs at niceness %d (Ray's worker_niceness) and may not lower it: start the "
                        "Ray nodes with RAY_worker_niceness=0 so other processes on the host cannot stall its steps",
                        os.getpriority(os.PRIO_PROCESS, tid))
            break
    return raised


def _placed(config: WorkerConfig) -> WorkerConfig:
    """`config` with this actor's Ray node id and node IP filled in."""
    return replace(config, node_id=ray.get_runtime_context().get_node_id(), host=ray.util.get_node_ip_address())


class PrefillWorker(EngineWorker):
    """Runs prompts to their first token and pushes their KV blocks to decode workers."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != Role.PREFILL:
            raise ValueError(f"PrefillWorker needs role 'prefill', got {config.role!r}")
        normal_priority()  # before the engine's threads start: they inherit it
        super().__init__(_placed(config))


class DecodeWorker(EngineWorker):
    """Receives KV blocks, decodes in a continuous batch, and can prefill locally."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != Role.DECODE:
            raise ValueError(f"DecodeWorker needs role 'decode', got {config.role!r}")
        normal_priority()  # before the engine's threads start: they inherit it
        super().__init__(_placed(config))


# Actor methods block (long polls, waits for first tokens), so each actor serves calls on a pool
# of threads; the engine itself runs on its own thread.
ACTOR_MAX_CONCURRENCY = 64


def actor_class(role: str):
    cls = PrefillWorker if role == Role.PREFILL else DecodeWorker
    return ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)(cls)
