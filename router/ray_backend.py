"""The serving backend over Ray actor pools: runs each request's lifecycle across the two pools.

Remote prefill: reserve blocks on the decode worker D -> prefill worker P computes the prompt and
pushes its KV into them -> the first token goes to the client -> D decodes the rest. Local
prefill: D runs the whole request. Tokens come back through one long-poll loop per decode worker
that carries every request's new tokens at once (router.pools, which also owns the workers'
health, the prefix index's KV events, and adding and draining workers at runtime).

Healing: a request whose decode worker dies **migrates** (router.migration): another decode
worker re-prefills prompt + the tokens already streamed and the stream goes on with no token
repeated or lost, up to `max_migrations` times (draining a worker moves its requests the same way,
without counting); then it ends with a clean, retryable error. With no other decode worker the
request waits up to `migration_wait_s` for one (a restarting one counts). A prefill worker that
dies mid-request is replaced by another prefill worker, or by D itself; nothing waits forever.

Imports ray but never torch: worker-side objects (KV endpoints included) cross as the torch-free
dataclasses of workers.protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayError

from router.backend import BackendError, GenerateRequest
from router.migration import Progress, WorkerLost
from router.pools import PoolWorker, Stream, WorkerPools
from router.prefix_index import PrefixIndex
from workers.protocol import PrefillRequest, RequestOutput

log = logging.getLogger("baton.router")


class _PrefillLost(Exception):
    """The prefill worker died during a remote prefill (the reservation on D is already aborted)."""


class RayBackend(WorkerPools):
    def __init__(self, workers: list[tuple[str, str, object]], health_interval_s: float = 2.0,
                 health_timeout_s: float = 10.0, poll_timeout_s: float = 0.05,
                 prefix_index: PrefixIndex | None = None, max_migrations: int = 3,
                 migration_wait_s: float = 30.0) -> None:
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        if not migration_wait_s >= 0:
            raise ValueError(f"migration_wait_s must be >= 0, got {migration_wait_s}")
        super().__init__(workers, health_interval_s, health_timeout_s, poll_timeout_s, prefix_index)
        self.max_migrations = max_migrations
        self.migration_wait_s = migration_wait_s
        self.counters = {"remote_prefill": 0, "local_prefill": 0, "prefill_fallbacks": 0, "prefill_retries": 0,
                         "kv_blocks_transferred": 0, "kv_bytes_transferred": 0, "migrations": 0,
                         "migrations_failed": 0}
        # Seconds from losing a request's decode worker to its next token on the new one (bounded).
        self.migration_gaps: deque[float] = deque(maxlen=1000)
        # RPCs that create a request's state on a decode worker (submit, reserve, start_decode), kept
        # while in flight or while their caller was cancelled: the worker is a threaded actor and may
        # run a later abort first, so the abort waits for them (else a reservation made after its
        # abort would hold blocks forever).
        self._creating: dict[str, object] = {}

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._ensure_started()
        rid = request.request_id
        # The route was chosen a moment ago; its decode worker may have died or started draining since.
        decode = self._usable(request.route.decode_worker) or self._pick("decode")
        if decode is None:
            raise BackendError("no live decode worker", retryable=True)
        stream = Stream(decode.worker_id, asyncio.Queue())
        self._streams[rid] = stream
        trace = request.trace
        started = submitted = time.perf_counter()
        progress = Progress()
        lost_at: float | None = None
        # Count the prompt as queued on whoever prefills it, until its first token (whole prompts:
        # see the kv-aware cost in router.routing).
        queued_on = request.route.prefill_worker or decode.worker_id
        queued = len(request.prompt_token_ids)
        self._queued_prefill[queued_on] = self._queued_prefill.get(queued_on, 0) + queued
        finished = False
        try:
            while not finished:
                try:
                    if progress.moves == 0:
                        first = None
                        if request.route.prefill_worker is not None:
                            first = await self._prefill_remotely(request, decode, stream)
                            if first is None and trace is not None:
                                trace.fell_back_to_local = True
                        if first is None:
                            self.counters["local_prefill"] += 1
                            submitted = time.perf_counter()
                            if trace is not None:
                                trace.queue_s = submitted - started
                            await self._create_on(decode, rid, decode.handle.submit.remote(
                                rid, request.prompt_token_ids, request.sampling_params))
                        else:
                            self._dequeue(queued_on, queued)
                            queued = 0
                            finished = first.finished
                            progress.add(first)
                            yield first
                            # D's start_decode went out with the first token; it is awaited only now,
                            # so the client does not wait for D's current engine step.
                            starting = self._creating.get(rid)
                            if not finished and starting is not None:
                                await self._create_on(decode, rid, starting)
                    else:
                        await self._resubmit(request, decode, progress)
                    while not finished:
                        item = await stream.queue.get()
                        if isinstance(item, Exception):
                            raise item
                        if queued:
                            self._dequeue(queued_on, queued)
                            queued = 0
                            if trace is not None:
                                trace.prefill_s = time.perf_counter() - submitted
                                trace.cached_tokens = item.num_cached_tokens
                        if lost_at is not None and item.token_ids:
                            self.migration_gaps.append(time.perf_counter() - lost_at)
                            lost_at = None
                        finished = item.finished
                        progress.add(item)
                        yield item
                except WorkerLost as lost:
                    lost_at = lost_at or time.perf_counter()
                    decode = await self._move(request, stream, progress, lost)
        finally:
            if queued:
                self._dequeue(queued_on, queued)
            self._streams.pop(rid, None)
            if not finished:
                # The consumer went away (client disconnect) or something failed: free the
                # request's blocks in both pools. A task, because this may run while closing.
                asyncio.get_running_loop().create_task(self._abort_on(rid, stream))

    async def _move(self, request: GenerateRequest, stream: Stream, progress: Progress, lost: WorkerLost):
        """Pick the decode worker that continues the request after `lost`; raise BackendError when
        its attempts are used up or no decode worker comes back within migration_wait_s."""
        rid = request.request_id
        if lost.failure:
            progress.migrations += 1
            if progress.migrations > self.max_migrations:
                self.counters["migrations_failed"] += 1
                raise BackendError(f"request {rid} lost its decode worker {progress.migrations} times (last "
                                   f"{lost.worker_id}: {lost}); giving up after {self.max_migrations} migrations",
                                   retryable=True) from None
        old = self._workers.get(lost.worker_id)
        # Whatever the old worker still holds of the request must go (it may only have been slow).
        if old is not None and not old.gone:
            asyncio.get_running_loop().create_task(self._abort_quietly(old, rid))
        deadline = time.monotonic() + self.migration_wait_s
        target = self._pick("decode", exclude={lost.worker_id})
        while target is None:
            # No other decode worker: wait for one, the lost one restarted included.
            if time.monotonic() > deadline:
                self.counters["migrations_failed"] += 1
                raise BackendError(f"request {rid}: decode worker {lost.worker_id} was lost and no decode worker "
                                   f"was live within {self.migration_wait_s:.0f} s to continue it", retryable=True)
            await asyncio.sleep(min(0.1, self.health_interval_s))
            target = self._pick("decode")
            if target is not None and target.worker_id == lost.worker_id:
                await self._abort_quietly(target, rid)  # back after a restart: make sure it is free of it
        progress.moves += 1
        self.counters["migrations"] += 1
        log.warning("request %s moves from %s to %s after %d tokens", rid, lost.worker_id, target.worker_id,
                    len(progress.output_token_ids))
        stream.decode_worker, stream.queue, stream.prefill_worker = target.worker_id, asyncio.Queue(), None
        if request.trace is not None:
            request.trace.decode_worker = target.worker_id
        return target

    async def _resubmit(self, request: GenerateRequest, decode: PoolWorker, progress: Progress) -> None:
        """Continue the request on `decode` from what the client has (a fresh start if nothing)."""
        try:
            await self._call(decode, decode.handle.submit.remote(request.request_id, request.prompt_token_ids,
                                                                 request.sampling_params, progress.resume_state()))
        except WorkerLost:
            raise
        except RayError as exc:  # refused (a bug, or a worker that cannot hold the context): no retry helps
            self.counters["migrations_failed"] += 1
            raise BackendError(f"request {request.request_id} could not continue on {decode.worker_id}: {exc}") from None

    async def _abort_quietly(self, w: PoolWorker, request_id: str, final: bool = False) -> None:
        try:
            # Not final by default: the request goes on elsewhere, or here again after a restart.
            await asyncio.wait_for(w.handle.abort.remote(request_id, final), self.health_timeout_s)
        except (RayError, asyncio.TimeoutError):
            pass  # dead or hung: it holds nothing we can free from here

    def _dequeue(self, worker_id: str, tokens: int) -> None:
        self._queued_prefill[worker_id] = max(0, self._queued_prefill.get(worker_id, 0) - tokens)

    async def _call(self, w: PoolWorker, ref):
        try:
            return await self._unless_down(w, ref)
        except RayActorError as exc:
            self._mark_down(w, exc)
            if w.role == "decode":
                raise WorkerLost(w.worker_id, f"decode worker {w.worker_id} died: {exc}") from exc
            raise BackendError(f"{w.role} worker {w.worker_id} died: {exc}", retryable=True) from exc

    async def _prefill_remotely(self, request: GenerateRequest, decode: PoolWorker, stream: Stream) -> RequestOutput | None:
        """Remote prefill on the routed prefill worker, or on another one if it dies; None: prefill on D."""
        prefill = self._usable(request.route.prefill_worker) or self._pick("prefill")
        tried: set[str] = set()
        while prefill is not None:
            tried.add(prefill.worker_id)
            stream.prefill_worker = prefill.worker_id
            if request.trace is not None:
                request.trace.prefill_worker = prefill.worker_id
            try:
                return await self._remote_prefill(request, decode, prefill)
            except _PrefillLost:
                prefill = self._pick("prefill", exclude=tried)
                if prefill is not None:
                    self.counters["prefill_retries"] += 1
                    log.warning("retrying the prefill of %s on %s", request.request_id, prefill.worker_id)
            finally:
                stream.prefill_worker = None
        if request.trace is not None:
            request.trace.prefill_worker = None
        return None

    async def _remote_prefill(self, request: GenerateRequest, decode: PoolWorker, prefill: PoolWorker) -> RequestOutput | None:
        """Prefill on P into blocks reserved on D. Returns the first token, or None to prefill on D instead."""
        rid = request.request_id
        started = time.perf_counter()
        reservation = await self._create_on(decode, rid, decode.handle.reserve.remote(
            rid, request.prompt_token_ids, request.sampling_params))
        if reservation is None:
            return None  # D has no room right now: queue it there as a local request
        endpoint = await self._call(decode, self._endpoint(decode))
        try:
            sent = time.perf_counter()
            result = await self._unless_down(prefill, prefill.handle.prefill.remote(PrefillRequest(
                rid, request.prompt_token_ids, request.sampling_params, endpoint,
                reservation.block_ids, reservation.num_cached_tokens,
            )))
        except RayActorError as exc:
            self._mark_down(prefill, exc)
            log.warning("prefill worker %s died during %s", prefill.worker_id, rid)
            self.counters["prefill_fallbacks"] += 1
            await self._call(decode, decode.handle.abort.remote(rid, False))  # reserved again next try
            raise _PrefillLost() from exc
        except RayError as exc:
            log.warning("remote prefill of %s failed (%s); prefilling on %s", rid, exc, decode.worker_id)
            self.counters["prefill_fallbacks"] += 1
            await self._call(decode, decode.handle.abort.remote(rid, False))  # submitted there next
            return None
        self.counters["remote_prefill"] += 1
        self.counters["kv_blocks_transferred"] += result.num_blocks_sent
        self.counters["kv_bytes_transferred"] += result.bytes_sent
        trace = request.trace
        if trace is not None:
            rpc = time.perf_counter() - sent
            trace.queue_s = (sent - started) + max(0.0, rpc - result.prefill_seconds - result.transfer_seconds)
            trace.prefill_s = result.prefill_seconds
            trace.transfer_s = result.transfer_seconds
            trace.kv_bytes = result.bytes_sent
            trace.kv_blocks = result.num_blocks_sent
            trace.cached_tokens = result.output.num_cached_tokens
        if result.output.finished:  # nothing to decode: free the reservation, not holding the answer back
            asyncio.get_running_loop().create_task(self._abort_quietly(decode, rid, final=True))
        else:
            # Sent now, awaited by generate() after it yields the first token; an abort meanwhile
            # waits for it (_abort_on), so the start cannot land after the abort.
            self._creating[rid] = decode.handle.start_decode.remote(rid, result.output.token_ids[0])
        return result.output

    async def _create_on(self, w: PoolWorker, request_id: str, ref):
        """Await an RPC creating the request's state on `w`; cancelled, it stays in `_creating`."""
        self._creating[request_id] = ref
        try:
            result = await self._call(w, ref)
        except asyncio.CancelledError:
            raise  # the abort that follows waits for the RPC, then frees what it made
        except BaseException:
            self._creating.pop(request_id, None)
            raise
        self._creating.pop(request_id, None)
        return result

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            await self._abort_on(request_id, stream)

    async def _abort_on(self, request_id: str, stream: Stream) -> None:
        creating = self._creating.pop(request_id, None)
        if creating is not None:
            try:
                await asyncio.wait_for(asyncio.ensure_future(creating), self.health_timeout_s)
            except Exception:
                pass  # failed, hung or not awaitable twice: the abort below still goes out
        targets = [stream.decode_worker] + ([stream.prefill_worker] if stream.prefill_worker else [])
        for wid in targets:
            w = self._workers.get(wid)
            if w is not None and w.alive:
                try:
                    await w.handle.abort.remote(request_id)
                except RayError:
                    pass  # a dead worker holds nothing any more
