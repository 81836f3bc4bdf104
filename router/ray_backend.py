"""The serving backend over Ray actor pools: runs each request's lifecycle across the two pools.

Remote prefill: reserve blocks on the decode worker D -> prefill worker P computes the prompt and
pushes its KV into them -> the first token goes to the client -> D decodes the rest. Local
prefill: D runs the whole request. Tokens come back through one long-poll loop per decode worker
that carries every request's new tokens at once.

KV events: the health loop's one `heartbeat` RPC per worker and interval returns the worker's
stats and its KV events since the last one; they feed `prefix_index` (a `PrefixIndex`), which
the KV-aware routing policy reads. A worker that stops answering, dies, or restarts (new pid) has
its index entries dropped at once, so nothing is routed to it for its cache.

Failures: a prefill worker that dies (or whose transfer fails) makes D prefill locally instead;
a decode worker that dies fails its requests with a retryable error; nothing waits forever.
Imports ray but never torch: worker-side objects cross as torch-free dataclasses or bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import ray
from ray.exceptions import RayActorError, RayError

from router.backend import BackendError, GenerateRequest, WorkerInfo
from router.prefix_index import PrefixIndex
from workers.protocol import RequestOutput
from workers.protocol import PrefillRequest

log = logging.getLogger("baton.router")


@dataclass
class _Worker:
    worker_id: str
    role: str
    handle: object
    alive: bool = True
    stats: object | None = None
    endpoint: bytes | None = None
    last_seen: float = field(default_factory=time.monotonic)
    last_heartbeat: float | None = None  # wall clock of the last answer


@dataclass
class _Stream:
    decode_worker: str
    queue: asyncio.Queue
    prefill_worker: str | None = None


class RayBackend:
    def __init__(self, workers: list[tuple[str, str, object]], health_interval_s: float = 2.0,
                 health_timeout_s: float = 10.0, poll_timeout_s: float = 0.05,
                 prefix_index: PrefixIndex | None = None) -> None:
        self._workers = {wid: _Worker(wid, role, handle) for wid, role, handle in workers}
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.poll_timeout_s = poll_timeout_s
        self._streams: dict[str, _Stream] = {}
        self.prefix_index = prefix_index if prefix_index is not None else PrefixIndex()
        self.block_size = 16  # updated from the workers' heartbeats
        self._queued_prefill: dict[str, int] = {wid: 0 for wid in self._workers}
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Seconds from a worker queueing an output to the router receiving it (bounded sample).
        self.stream_delays: deque[float] = deque(maxlen=10000)
        self.counters = {"remote_prefill": 0, "local_prefill": 0, "prefill_fallbacks": 0,
                         "kv_blocks_transferred": 0, "kv_bytes_transferred": 0}

    # ---- lifecycle ---------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._tasks and self._loop is loop:
            return
        # First use, or a new event loop (a second router app over the same workers, after the
        # first one's server stopped): the old loop's tasks are gone with it; start them here.
        self._loop = loop
        self._tasks = []
        self._tasks.append(loop.create_task(self._health_loop()))
        for w in self._workers.values():
            if w.role == "decode":
                self._tasks.append(loop.create_task(self._pump(w)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    def workers(self) -> list[WorkerInfo]:
        try:
            self._ensure_started()
        except RuntimeError:
            pass  # no running loop (called from sync code): report what we know
        infos = []
        for w in self._workers.values():
            s = w.stats
            infos.append(WorkerInfo(
                worker_id=w.worker_id, role=w.role, alive=w.alive,
                running=s.num_running if s else 0, waiting=s.num_waiting if s else 0,
                kv_usage=s.kv_usage if s else 0.0, queued_prefill_tokens=self._queued_prefill.get(w.worker_id, 0),
                prefix_cache_queries=s.prefix_cache_queries if s else 0, prefix_cache_hits=s.prefix_cache_hits if s else 0,
                last_heartbeat=w.last_heartbeat,
            ))
        return infos

    def worker_stats(self) -> dict[str, object]:
        return {wid: w.stats for wid, w in self._workers.items()}

    async def refresh_stats(self) -> None:
        """Ask every worker for its stats and KV events now; a worker that does not answer is marked dead."""
        async def one(w: _Worker) -> None:
            try:
                beat = await asyncio.wait_for(w.handle.heartbeat.remote(), self.health_timeout_s)
            except (RayError, asyncio.TimeoutError) as exc:
                self._mark_down(w, exc)
                return
            old = w.stats
            if old is not None and (old.pid != beat.stats.pid or not w.alive):
                # Restarted (or back from the dead): what we knew of its cache is gone.
                self.prefix_index.remove_worker(w.worker_id)
            w.stats = beat.stats
            w.alive, w.last_seen, w.last_heartbeat = True, time.monotonic(), time.time()
            batch = beat.kv_events
            self.block_size = batch.block_size
            if batch.snapshot is not None:
                self.prefix_index.replace(w.worker_id, batch.snapshot)
            else:
                self.prefix_index.apply(w.worker_id, batch.events)

        await asyncio.gather(*(one(w) for w in self._workers.values()))

    def _mark_down(self, w: _Worker, exc: object) -> None:
        if w.alive:
            log.warning("worker %s (%s) is down: %s", w.worker_id, w.role, exc)
        w.alive = False
        self.prefix_index.remove_worker(w.worker_id)
        if w.role == "decode":
            self._fail_streams(w.worker_id, f"decode worker {w.worker_id} is down")

    async def _health_loop(self) -> None:
        while True:
            await self.refresh_stats()
            await asyncio.sleep(self.health_interval_s)

    async def _pump(self, w: _Worker) -> None:
        while True:
            if not w.alive:
                await asyncio.sleep(self.health_interval_s)
                continue
            try:
                outputs = await w.handle.poll_outputs.remote(self.poll_timeout_s)
            except RayError as exc:
                self._mark_down(w, exc)
                continue
            now = time.time()
            for out in outputs:
                self.stream_delays.append(now - out.created_at)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.queue.put_nowait(out)

    def _fail_streams(self, decode_worker: str, message: str) -> None:
        for stream in self._streams.values():
            if stream.decode_worker == decode_worker:
                stream.queue.put_nowait(BackendError(message, retryable=True))

    def _get(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            raise BackendError(f"unknown worker {worker_id!r}")
        return w

    async def _endpoint(self, w: _Worker) -> bytes:
        if w.endpoint is None:
            w.endpoint = await w.handle.endpoint.remote()
        return w.endpoint

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._ensure_started()
        rid = request.request_id
        decode = self._get(request.route.decode_worker)
        stream = _Stream(decode.worker_id, asyncio.Queue())
        self._streams[rid] = stream
        trace = request.trace
        started = time.perf_counter()
        # Count the prompt as queued on whoever prefills it, until its first token (whole prompts:
        # see the kv-aware cost in router.routing).
        queued_on = request.route.prefill_worker or decode.worker_id
        queued = len(request.prompt_token_ids)
        self._queued_prefill[queued_on] = self._queued_prefill.get(queued_on, 0) + queued
        finished = False
        try:
            first = None
            if request.route.prefill_worker is not None:
                stream.prefill_worker = request.route.prefill_worker
                first = await self._remote_prefill(request, decode, self._get(request.route.prefill_worker))
                stream.prefill_worker = None
                if first is None and trace is not None:
                    trace.fell_back_to_local = True
            if first is None:
                self.counters["local_prefill"] += 1
                submitted = time.perf_counter()
                if trace is not None:
                    trace.queue_s = submitted - started
                await self._call(decode, decode.handle.submit.remote(rid, request.prompt_token_ids, request.sampling_params))
            else:
                self._dequeue(queued_on, queued)
                queued = 0
                finished = first.finished
                yield first
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True  # the worker is gone; nothing left to abort there
                    raise item
                if queued:
                    self._dequeue(queued_on, queued)
                    queued = 0
                    if trace is not None:
                        trace.prefill_s = time.perf_counter() - submitted
                        trace.cached_tokens = item.num_cached_tokens
                finished = item.finished
                yield item
        finally:
            if queued:
                self._dequeue(queued_on, queued)
            self._streams.pop(rid, None)
            if not finished:
                # The consumer went away (client disconnect) or something failed: free the
                # request's blocks in both pools. A task, because this may run while closing.
                asyncio.get_running_loop().create_task(self._abort_on(rid, stream))

    def _dequeue(self, worker_id: str, tokens: int) -> None:
        self._queued_prefill[worker_id] = max(0, self._queued_prefill.get(worker_id, 0) - tokens)

    async def _call(self, w: _Worker, ref):
        try:
            return await ref
        except RayActorError as exc:
            self._mark_down(w, exc)
            raise BackendError(f"{w.role} worker {w.worker_id} died: {exc}", retryable=True) from exc

    async def _remote_prefill(self, request: GenerateRequest, decode: _Worker, prefill: _Worker) -> RequestOutput | None:
        """Prefill on P into blocks reserved on D. Returns the first token, or None to prefill on D instead."""
        rid = request.request_id
        started = time.perf_counter()
        reservation = await self._call(decode, decode.handle.reserve.remote(rid, request.prompt_token_ids, request.sampling_params))
        if reservation is None:
            return None  # D has no room right now: queue it there as a local request
        try:
            endpoint = await self._endpoint(decode)
            sent = time.perf_counter()
            result = await prefill.handle.prefill.remote(PrefillRequest(
                rid, request.prompt_token_ids, request.sampling_params, endpoint,
                reservation.block_ids, reservation.num_cached_tokens,
            ))
        except RayActorError as exc:
            self._mark_down(prefill, exc)
            log.warning("prefill worker %s died during %s; prefilling on %s", prefill.worker_id, rid, decode.worker_id)
            self.counters["prefill_fallbacks"] += 1
            await self._call(decode, decode.handle.abort.remote(rid))
            return None
        except RayError as exc:
            log.warning("remote prefill of %s failed (%s); prefilling on %s", rid, exc, decode.worker_id)
            self.counters["prefill_fallbacks"] += 1
            await self._call(decode, decode.handle.abort.remote(rid))
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
        if result.output.finished:
            await self._call(decode, decode.handle.abort.remote(rid))  # nothing to decode: free the reservation
        else:
            await self._call(decode, decode.handle.start_decode.remote(rid, result.output.token_ids[0]))
        return result.output

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            await self._abort_on(request_id, stream)

    async def _abort_on(self, request_id: str, stream: _Stream) -> None:
        targets = [stream.decode_worker] + ([stream.prefill_worker] if stream.prefill_worker else [])
        for wid in targets:
            w = self._workers[wid]
            if w.alive:
                try:
                    await w.handle.abort.remote(request_id)
                except RayError:
                    pass  # a dead worker holds nothing any more
