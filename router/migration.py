"""Moving a request off a decode worker that died or is being removed (migration): the signal and
the choice of where it goes.

The router is the one place that knows what a client already has: every token id and every
character of text it streamed (`router.flow.RequestFlow` keeps it). When the request's decode worker
is lost, a `ResumeState` carries it to another decode worker, which re-prefills prompt + those
tokens (its prefix cache helps) and decodes on (workers.engine.llm_engine.LLMEngine.resume_request): the
stream continues with no token or character repeated or lost, and greedy output is what an
undisturbed run gives.

`WorkerLost` is how a lost decode worker reaches the request: raised by a failed call to it, or
put into the request's queue when the health loop, the output pump or a drain gives it up.
`pick_worker` chooses where a request goes when the router's policy is not asked again (a
migration, a prefill retry): the least busy live worker of the pool that takes new requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.backend import BackendError, WorkerInfo

__all__ = ["WorkerLost", "pick_worker"]


class WorkerLost(BackendError):
    """A request's decode worker is gone (died, stopped answering, or drained): move the request."""

    def __init__(self, worker_id: str, message: str, failure: bool = True, attempt: int | None = None) -> None:
        super().__init__(message, retryable=True)
        self.worker_id = worker_id
        # False for a drain: moving off a worker being removed is no failure and uses no attempt.
        self.failure = failure
        # The request's attempt when the loss was seen (router.flow.RequestFlow.moves; None: now).
        self.attempt = attempt


def pick_worker(workers: Iterable[WorkerInfo], exclude: frozenset[str] = frozenset()) -> str | None:
    """The usable worker (alive, not draining) with the fewest requests in flight, then the lowest
    KV usage, then the id; None when there is none outside `exclude`."""
    usable = [w for w in workers if w.alive and not w.draining and w.worker_id not in exclude]
    if not usable:
        return None
    return min(usable, key=lambda w: (w.in_flight, w.kv_usage, w.worker_id)).worker_id
