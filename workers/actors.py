"""Ray actor shells for the two pools. All behaviour lives in workers.worker.EngineWorker.

The shells add what only Ray knows: the node the actor landed on and that node's IP, which the
KV transport per pair of workers needs (`WorkerConfig.node_id`, `host`).
"""

from __future__ import annotations

from dataclasses import replace

import ray

from common.roles import Role
from workers.worker import EngineWorker, WorkerConfig


def _placed(config: WorkerConfig) -> WorkerConfig:
    """`config` with this actor's Ray node id and node IP filled in."""
    return replace(config, node_id=ray.get_runtime_context().get_node_id(), host=ray.util.get_node_ip_address())


class PrefillWorker(EngineWorker):
    """Runs prompts to their first token and pushes their KV blocks to decode workers."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != Role.PREFILL:
            raise ValueError(f"PrefillWorker needs role 'prefill', got {config.role!r}")
        super().__init__(_placed(config))


class DecodeWorker(EngineWorker):
    """Receives KV blocks, decodes in a continuous batch, and can prefill locally."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != Role.DECODE:
            raise ValueError(f"DecodeWorker needs role 'decode', got {config.role!r}")
        super().__init__(_placed(config))


# Actor methods block (long polls, waits for first tokens), so each actor serves calls on a pool
# of threads; the engine itself runs on its own thread.
ACTOR_MAX_CONCURRENCY = 64


def actor_class(role: str):
    cls = PrefillWorker if role == Role.PREFILL else DecodeWorker
    return ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)(cls)
