"""Ray actor shells for the two pools. All behaviour lives in workers.worker.EngineWorker."""

from __future__ import annotations

from workers.worker import EngineWorker, WorkerConfig


class PrefillWorker(EngineWorker):
    """Runs prompts to their first token and pushes their KV blocks to decode workers."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != "prefill":
            raise ValueError(f"PrefillWorker needs role 'prefill', got {config.role!r}")
        super().__init__(config)


class DecodeWorker(EngineWorker):
    """Receives KV blocks, decodes in a continuous batch, and can prefill locally."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != "decode":
            raise ValueError(f"DecodeWorker needs role 'decode', got {config.role!r}")
        super().__init__(config)


# Actor methods block (long polls, waits for first tokens), so each actor serves calls on a pool
# of threads; the engine itself runs on its own thread.
ACTOR_MAX_CONCURRENCY = 64


def actor_class(role: str):
    import ray

    cls = PrefillWorker if role == "prefill" else DecodeWorker
    return ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)(cls)
