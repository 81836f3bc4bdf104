"""Moving a request off a decode worker that died or is being removed (migration).

The router is the one place that knows what a client already has: every token id and every
character of text it streamed. `Progress` keeps that per request; when the request's decode worker
is lost, `ResumeState` carries it to another decode worker, which re-prefills prompt + those
tokens (its prefix cache helps) and decodes on (workers.engine.LLMEngine.resume_request): the
stream continues with no token or character repeated or lost, and greedy output is what an
undisturbed run gives. Stop conditions, max_tokens and usage stay the whole request's because the
new worker's sequence holds the tokens already produced as output, not as prompt.

`WorkerLost` is how a lost decode worker reaches the request: raised by a failed call to it, or
put into the request's queue when the health loop, the output pump or a drain gives it up.
`pick_worker` chooses where a request goes when the router's policy is not asked again (a
migration, a prefill retry): the least busy live worker of the pool that takes new requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from router.backend import BackendError
from workers.protocol import RequestOutput, ResumeState

__all__ = ["Candidate", "Progress", "WorkerLost", "pick_worker"]


class WorkerLost(BackendError):
    """A request's decode worker is gone (died, stopped answering, or drained): move the request."""

    def __init__(self, worker_id: str, message: str, failure: bool = True) -> None:
        super().__init__(message, retryable=True)
        self.worker_id = worker_id
        # False for a drain: moving off a worker being removed is no failure and uses no attempt.
        self.failure = failure


@dataclass
class Progress:
    """What the client has of one request so far, and how often it moved."""

    output_token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    migrations: int = 0  # failed decode workers so far
    moves: int = 0  # every move, drains included

    def add(self, out: RequestOutput) -> None:
        self.output_token_ids.extend(out.token_ids)
        self.text_chars += len(out.text)

    def resume_state(self) -> ResumeState | None:
        """What the next decode worker continues from (None: nothing streamed yet, start afresh)."""
        if not self.output_token_ids:
            return None
        return ResumeState(tuple(self.output_token_ids), self.text_chars)


@dataclass(frozen=True)
class Candidate:
    """A worker as pick_worker sees it."""

    worker_id: str
    usable: bool  # alive and not draining
    streams: int  # requests the router has on it now
    load: float = 0.0  # tie-break: KV usage reported by its last heartbeat


def pick_worker(candidates: Iterable[Candidate], exclude: set[str] = frozenset()) -> str | None:
    """The usable candidate with the fewest streams (then the lowest load, then the id), or None."""
    usable = [c for c in candidates if c.usable and c.worker_id not in exclude]
    if not usable:
        return None
    return min(usable, key=lambda c: (c.streams, c.load, c.worker_id)).worker_id
