"""Small thread-safe records an engine worker keeps beside its engine: the requests ended for good
(so a late creation call is refused) and its counters."""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["AbortedIds", "Counters", "RequestAborted"]


class RequestAborted(RuntimeError):
    """The request was ended for good before this call reached the worker."""


class AbortedIds:
    """The ids of the last `capacity` requests the router ended for good (engine thread only).

    A call that creates a request's state (submit, reserve, prefill) can reach a worker after the
    router's abort of that request did, when the two race through different Ray call threads; the
    state it made would then be held until the worker restarts. Creation calls check this list."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def refuse(self, request_id: str) -> None:
        """Raise RequestAborted if the request was ended for good."""
        if request_id in self._ids:
            raise RequestAborted(f"request {request_id} was aborted before this call reached the worker")


class Counters:
    """Named integer counters that any thread may add to (Ray call threads and the engine thread)."""

    def __init__(self, *names: str) -> None:
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        """Add to one or more counters at once (readers see all of them or none)."""
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown counter {name!r}; known: {sorted(self._values)}")
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
