"""Routing policies: which prefill worker and which decode worker serve a request.

The interface is one method, `choose(prompt_token_ids, workers) -> RouteDecision`, so a
KV-aware policy (prefix overlap, load, conditional disaggregation) can replace round-robin
without touching the HTTP layer.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from router.backend import RouteDecision, WorkerInfo

__all__ = ["NoWorkerAvailable", "RoundRobinPolicy", "RoutingPolicy", "live_workers"]


class NoWorkerAvailable(RuntimeError):
    """A pool has no live worker; the router answers 503 with Retry-After."""

    def __init__(self, pool: str, message: str | None = None) -> None:
        self.pool = pool
        super().__init__(message or f"no live {pool} worker is available; retry later")


class RoutingPolicy(Protocol):
    def choose(self, prompt_token_ids: Sequence[int], workers: Sequence[WorkerInfo]) -> RouteDecision:
        """Pick the workers for one request; raise NoWorkerAvailable when a needed pool is empty."""
        ...


def live_workers(workers: Sequence[WorkerInfo], role: str) -> list[WorkerInfo]:
    return [w for w in workers if w.role == role and w.alive]


class RoundRobinPolicy:
    """Prefill round-robin over live prefill workers, decode round-robin over live decode workers.

    Each pool keeps the id of the worker it picked last and moves to the next live one in id
    order, so a worker dying or joining does not reshuffle the others. With
    `local_prefill_fallback`, an empty prefill pool means the decode worker prefills locally
    instead of a 503.
    """

    def __init__(self, local_prefill_fallback: bool = False) -> None:
        self.local_prefill_fallback = local_prefill_fallback
        self._last: dict[str, str | None] = {"prefill": None, "decode": None}

    def _next(self, workers: Sequence[WorkerInfo], role: str) -> str | None:
        ids = sorted(w.worker_id for w in live_workers(workers, role))
        if not ids:
            return None
        last = self._last[role]
        chosen = ids[0]
        if last is not None:
            chosen = next((i for i in ids if i > last), ids[0])
        self._last[role] = chosen
        return chosen

    def choose(self, prompt_token_ids: Sequence[int], workers: Sequence[WorkerInfo]) -> RouteDecision:
        decode = self._next(workers, "decode")
        if decode is None:
            raise NoWorkerAvailable("decode")
        prefill = self._next(workers, "prefill")
        if prefill is None:
            if not self.local_prefill_fallback:
                raise NoWorkerAvailable("prefill")
            return RouteDecision(decode_worker=decode, prefill_worker=None, reason="local_prefill_no_prefill_worker")
        return RouteDecision(decode_worker=decode, prefill_worker=prefill, reason="round_robin")
