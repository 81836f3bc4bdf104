"""The requests a router has in the pools now: each one's flow, and the inbox its executor reads.

`RequestTable` is the one registry of live requests (router.ray_backend runs them; router.pools
hands them what the workers say). What a request is and where it stands is its flow's
(`router.flow.RequestFlow`): the table keeps nothing beside it but the I/O an executor needs, the
inbox of events from the workers and the creation call in flight on its decode worker.

Events reach a request's inbox from three places: a worker's outbox (`Delivered`: tokens, a
prefill's outcome), the pools' health loop or a drain (`router.migration.WorkerLost`), and calls
that run beside the flow (`CallFailed`: a StartDecode that failed). The flow drops what is stale.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from common.protocol import WorkerOutput
from common.request import WorkerRequest
from router.flow import RequestFlow
from router.flow_commands import Command
from router.migration import WorkerLost

__all__ = ["CallFailed", "Delivered", "Ended", "InboxEvent", "LiveRequest", "RequestTable"]


@dataclass(frozen=True)
class Delivered:
    """An item of a worker's outbox for this request."""

    worker_id: str
    item: WorkerOutput


@dataclass(frozen=True)
class CallFailed:
    """A call to a worker that ran beside the flow (StartDecode) failed with `error`."""

    worker_id: str
    error: BaseException
    attempt: int  # the request's attempt when the call went out (router.flow.RequestFlow.current)


@dataclass(frozen=True)
class Ended:
    """The flow was ended from outside its executor (an abort): stop waiting."""


InboxEvent = Delivered | CallFailed | Ended | WorkerLost


@dataclass
class LiveRequest:
    """A request running in the pools: its flow, what every worker call carries, the commands its
    executor has yet to run, its inbox, and the creation call in flight on its decode worker
    (awaited before a final abort, which a threaded actor might otherwise run first)."""

    flow: RequestFlow
    request: WorkerRequest
    pending: deque[Command] = field(default_factory=deque)
    inbox: asyncio.Queue[InboxEvent] = field(default_factory=asyncio.Queue)
    creating: Any = None


class RequestTable:
    """Live requests by id."""

    def __init__(self) -> None:
        self._live: dict[str, LiveRequest] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveRequest]:
        return iter(list(self._live.values()))  # a copy: read from other threads (workers()) too

    def open(self, live: LiveRequest) -> None:
        request_id = live.flow.request_id
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already running")
        self._live[request_id] = live

    def close(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def get(self, request_id: str) -> LiveRequest | None:
        return self._live.get(request_id)

    def deliver(self, worker_id: str, item: WorkerOutput) -> None:
        """A worker's outbox item: to its request's inbox (dropped when the request has left)."""
        live = self._live.get(item.request_id)
        if live is not None:
            live.inbox.put_nowait(Delivered(worker_id, item))

    def on_worker(self, worker_id: str) -> list[LiveRequest]:
        """The requests on `worker_id` now (decoding there, or prefilling there)."""
        return [live for live in self if worker_id in live.flow.workers()]

    def worker_lost(self, worker_id: str, message: str, failure: bool = True) -> int:
        """Tell the requests on the worker it is lost (`failure`) or being drained; returns how many."""
        on_it = self.on_worker(worker_id)
        for live in on_it:
            live.inbox.put_nowait(WorkerLost(worker_id, message, failure, live.flow.moves))
        return len(on_it)

    def in_flight_counts(self) -> dict[str, int]:
        """Requests on each worker now."""
        counts: dict[str, int] = {}
        for live in self:
            for worker_id in live.flow.workers():
                counts[worker_id] = counts.get(worker_id, 0) + 1
        return counts
