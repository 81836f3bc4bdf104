"""Driving an in-process worker (`workers.shell.worker.EngineWorker`, or any `common.worker_api.WorkerAPI`)
as the router does, from plain arguments: each helper builds the call's record (common.request) and
makes the call; `prefill` also waits for the prefill's outcome in the worker's outbox, as the router's
output pump does.

Outbox items a helper takes but does not want (another request's tokens, another prefill's outcome)
are kept per worker and handed to the next helper that asks for them, so helpers of several threads
can share a worker.
"""

from __future__ import annotations

import threading
import time
import weakref

from common.protocol import KVEndpoint, KVReservation, PrefillFailed, PrefillResult, ResumeState, RouterClaim
from common.request import (
    AbortRequest,
    PrefillRequest,
    RequestContext,
    RequestOwner,
    ReserveRequest,
    StartDecodeRequest,
    SubmitRequest,
    WorkerRequest,
)
from common.sampling_params import SamplingParams
from common.worker_api import WorkerAPI

__all__ = [
    "PrefillError",
    "abort",
    "prefill",
    "request",
    "reserve",
    "start_decode",
    "submit",
    "wait_prefilled",
]


class PrefillError(RuntimeError):
    """The worker reported the prefill failed (a PrefillFailed in its outbox)."""


def request(request_id: str, prompt: list[int], params: SamplingParams, adapter: str | None = None) -> WorkerRequest:
    return WorkerRequest(RequestContext(request_id, adapter=adapter), list(prompt), params)


def submit(
    worker: WorkerAPI,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    resume: ResumeState | None = None,
    router: RouterClaim | None = None,
    attempt: int = 0,
    adapter: str | None = None,
) -> None:
    call = SubmitRequest(request(request_id, prompt, params, adapter), RequestOwner(router, attempt), resume)
    worker.submit(call)


def reserve(
    worker: WorkerAPI,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    router: RouterClaim | None = None,
    attempt: int = 0,
    adapter: str | None = None,
) -> KVReservation | None:
    return worker.reserve(ReserveRequest(request(request_id, prompt, params, adapter), RequestOwner(router, attempt)))


def start_decode(worker: WorkerAPI, request_id: str, first_token: int, kv_namespace: str | None = None) -> None:
    worker.start_decode(StartDecodeRequest(request_id, first_token, kv_namespace))


def abort(worker: WorkerAPI, request_id: str, final: bool = True) -> bool:
    return worker.abort(AbortRequest(request_id, final))


def prefill(
    worker: WorkerAPI,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    peer: KVEndpoint | None = None,
    reservation: KVReservation | None = None,
    router: RouterClaim | None = None,
    timeout_s: float = 120.0,
    adapter: str | None = None,
) -> PrefillResult:
    """Prefill on `worker` into `reservation` on the decode worker whose endpoint is `peer` (None:
    nothing to send), and wait for the outcome; PrefillError when it failed."""
    block_ids = list(reservation.block_ids) if reservation is not None else []
    cached = reservation.num_cached_tokens if reservation is not None else 0
    call = PrefillRequest(request(request_id, prompt, params, adapter), peer, block_ids, cached, RequestOwner(router))
    worker.prefill(call)
    return wait_prefilled(worker, request_id, router, timeout_s)


# Per worker: outbox items taken by one helper for another request (a worker is a WorkerAPI: any object).
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def wait_prefilled(
    worker: WorkerAPI, request_id: str, router: RouterClaim | None = None, timeout_s: float = 120.0
) -> PrefillResult:
    """The outcome of `request_id`'s prefill on `worker`, from its outbox (PrefillError if it failed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _lock:
            kept = _kept.setdefault(worker, [])
            mine = next(
                (i for i in kept if isinstance(i, (PrefillResult, PrefillFailed)) and i.request_id == request_id), None
            )
            if mine is not None:
                kept.remove(mine)
        if isinstance(mine, PrefillFailed):
            raise PrefillError(mine.message)
        if mine is not None:
            return mine
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no prefill outcome for {request_id} within {timeout_s} s")
        items = worker.poll_outputs(min(left, 0.5), router)
        with _lock:
            _kept.setdefault(worker, []).extend(items)
