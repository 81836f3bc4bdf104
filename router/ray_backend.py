"""The serving backend over Ray actor pools: carries out each request's `router.flow.RequestFlow`
as Ray calls.

The flow decides (reserve on D, prefill on P, start decoding, resubmit after a migration, abort);
this module only makes the calls, turns their answers and failures into the flow's events, and
passes its outputs on. Tokens come back through one long-poll loop per decode worker that carries
every request's new tokens at once (router.pools, which also owns the workers' health, the prefix
index's KV events, and adding and draining workers at runtime).

What is Ray's alone stays here: a call to a worker that Ray is restarting is abandoned when the
health loop marks the worker down (`WorkerPools.unless_down`), and the calls that create a
request's state on a decode worker are kept until they return, because the worker is a threaded
actor that may run a later abort first (a final abort waits for them, else a reservation made
after its abort would hold blocks forever).

Imports ray but never torch: worker-side objects (KV endpoints included) cross as the torch-free
dataclasses of common.protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayError

from common.protocol import GrammarCompileError, PrefillRequest, RequestOutput
from common.roles import Role
from common.transports import KVLoadFailed
from router.backend import BackendError, GenerateRequest, WorkerInfo
from router.flow import (
    COUNTERS,
    Abort,
    Command,
    Count,
    Emit,
    Fail,
    FlowLimits,
    FlowState,
    Follow,
    MigrationGap,
    Prefill,
    QueueTokens,
    RequestFlow,
    Reserve,
    StartDecode,
    Submit,
    WaitForDecode,
)
from router.migration import WorkerLost
from router.pools import PoolWorker, Stream, WorkerPools
from router.prefix_index import PrefixIndex

__all__ = ["RayBackend"]

log = logging.getLogger("baton.router")


def _bad_input(exc: RayError) -> GrammarCompileError | None:
    """The worker's refusal of the request as bad input, when that is what `exc` carries: its
    structured output does not compile there. The worker raised it before holding anything; the
    generator's cleanup (the flow's on_client_gone) frees what the other pool holds, and the
    router answers 400 naming the field."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, GrammarCompileError) else None


class RayBackend:
    """`router.backend.ServingBackend` over `WorkerPools` of Ray actors."""

    def __init__(self, pools: WorkerPools, limits: FlowLimits | None = None) -> None:
        self.pools = pools
        self.limits = limits or FlowLimits()
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Seconds from losing a request's decode worker to its next token on the new one (bounded).
        self.migration_gaps: deque[float] = deque(maxlen=1000)
        # Creation RPCs (submit, reserve, start_decode) in flight, or whose caller was cancelled.
        self._creating: dict[str, object] = {}

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.pools.prefix_index

    def workers(self) -> list[WorkerInfo]:
        return self.pools.workers()

    def routers(self) -> dict:
        """This router's id and every router holding a lease on some worker (for /v1/status)."""
        return {"this": self.pools.router.router_id, "leases": self.pools.router_leases()}

    async def close(self) -> None:
        await self.pools.close()

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        # The prompt counts as queued on its worker from now, not from the first iteration: a burst
        # of requests is routed before any of them starts (WorkerPools.routed).
        route = request.route
        self.pools.routed(
            request.request_id,
            route.prefill_worker or route.decode_worker,
            len(request.prompt_token_ids),
            time.monotonic(),
        )
        return self._run(request)

    async def _run(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.pools.ensure_started()
        rid = request.request_id
        self.pools.forget_route(rid)  # flow.start queues the prompt itself, in this same step
        flow = RequestFlow(rid, len(request.prompt_token_ids), request.route, self.pools, self.limits, request.trace)
        stream = self.pools.open_stream(rid, request.route.decode_worker)
        pending: deque[Command] = deque(flow.start(time.monotonic()))
        try:
            while not flow.done or pending:
                if not pending:
                    # Only a decoding request waits for its stream; every other state has a command out.
                    assert flow.state is FlowState.DECODING, flow.state
                    item = await self._next_output(flow, stream)
                    if isinstance(item, WorkerLost):
                        pending.extend(flow.on_worker_lost(item.worker_id, item.failure, time.monotonic()))
                    else:
                        pending.extend(flow.on_output(item, time.monotonic()))
                    continue
                command = pending.popleft()
                if isinstance(command, Emit):
                    yield command.output
                elif isinstance(command, Fail):
                    raise BackendError(command.message, retryable=command.retryable)
                else:
                    try:
                        pending.extend(await self._execute(flow, request, stream, command))
                    except WorkerLost as lost:
                        pending.clear()  # the rest of the batch assumed the worker it just lost
                        pending.extend(flow.on_worker_lost(lost.worker_id, lost.failure, time.monotonic()))
        finally:
            self.pools.close_stream(rid)
            # A consumer that closes the stream at its finished output leaves the commands after
            # that Emit unrun: a finished first token's Abort of D's reservation is one of them.
            leftover = [c for c in pending if isinstance(c, (Abort, QueueTokens))]
            # The consumer went away (client disconnect) or something failed: free the request's
            # blocks in both pools. Tasks, because this may run while the generator closes.
            for command in leftover + flow.on_client_gone(time.monotonic()):
                if isinstance(command, Abort):
                    self._abort_in_background(rid, command)
                elif isinstance(command, QueueTokens):
                    self.pools.queue_tokens(command.worker_id, command.delta)

    async def _next_output(self, flow: RequestFlow, stream: Stream) -> RequestOutput | WorkerLost:
        # D's start_decode went out with the first token; it is awaited only now, so the client
        # does not wait for D's current engine step.
        starting = self._creating.get(flow.request_id)
        decode = self.pools.get(flow.decode_worker)
        if starting is not None and decode is not None:
            try:
                await self._create_on(decode, flow.request_id, starting)
            except WorkerLost as lost:  # D died before it could start: the flow moves the request
                return lost
            except RayError as exc:
                failed = getattr(exc, "cause", None)
                if isinstance(failed, KVLoadFailed):  # --kv-load-failure-policy fail: D freed it; retryable
                    raise BackendError(
                        f"the KV transfer of this request failed ({failed.reason}); retry it", retryable=True
                    ) from exc
                raise
        item = await stream.queue.get()
        if isinstance(item, Exception) and not isinstance(item, WorkerLost):
            raise item
        return item

    async def _execute(
        self, flow: RequestFlow, request: GenerateRequest, stream: Stream, command: Command
    ) -> list[Command]:
        """Carry out one command; returns the flow's answer to its outcome (or nothing)."""
        rid = flow.request_id
        if isinstance(command, Count):
            self.counters[command.name] += command.n
        elif isinstance(command, QueueTokens):
            self.pools.queue_tokens(command.worker_id, command.delta)
        elif isinstance(command, MigrationGap):
            self.migration_gaps.append(command.seconds)
        elif isinstance(command, Follow):
            if flow.moves:
                log.warning(
                    "request %s moves to %s after %d tokens", rid, command.worker_id, len(flow.output_token_ids)
                )
            self.pools.follow(stream, command.worker_id, command.attempt)
        elif isinstance(command, Reserve):
            decode = self._worker(command.worker_id)
            try:
                reservation = await self._create_on(
                    decode,
                    rid,
                    decode.handle.reserve.remote(
                        rid, request.prompt_token_ids, request.sampling_params, self.pools.router, stream.attempt
                    ),
                )
            except RayError as exc:
                bad = _bad_input(exc)
                if bad is not None:
                    raise bad from None
                raise
            return flow.on_reserved(reservation, time.monotonic())
        elif isinstance(command, Prefill):
            return await self._prefill(flow, request, stream, command)
        elif isinstance(command, StartDecode):
            decode = self._worker(command.worker_id)
            self._creating[rid] = decode.handle.start_decode.remote(rid, command.first_token)
        elif isinstance(command, Submit):
            decode = self._worker(command.worker_id)
            try:
                await self._create_on(
                    decode,
                    rid,
                    decode.handle.submit.remote(
                        rid,
                        request.prompt_token_ids,
                        request.sampling_params,
                        command.resume,
                        self.pools.router,
                        stream.attempt,
                    ),
                )
            except RayError as exc:  # refused (a bug, or a worker that cannot hold the context)
                bad = _bad_input(exc)
                if bad is not None:
                    raise bad from None
                return flow.on_submit_refused(command.worker_id, str(exc), time.monotonic())
        elif isinstance(command, Abort):
            if command.wait:
                w = self.pools.get(command.worker_id)
                if w is not None:
                    try:
                        await self._call(w, w.handle.abort.remote(rid, command.final))
                    except WorkerLost:
                        raise
                    except (RayError, BackendError):
                        pass  # a dead prefill worker, or a refusal: it holds nothing we can free
            else:
                self._abort_in_background(rid, command)
        elif isinstance(command, WaitForDecode):
            await asyncio.sleep(min(0.1, self.pools.health_interval_s))
            return flow.on_wait(time.monotonic())
        else:
            raise AssertionError(f"no executor for {command!r}")
        return []

    async def _prefill(
        self, flow: RequestFlow, request: GenerateRequest, stream: Stream, command: Prefill
    ) -> list[Command]:
        rid = flow.request_id
        decode, prefill = self._worker(command.decode_worker), self.pools.get(command.worker_id)
        if prefill is None:  # removed from its pool since the route was chosen
            return flow.on_prefill_failed(command.worker_id, died=True, now=time.monotonic())
        endpoint = await self._call(decode, self.pools.endpoint(decode))
        stream.prefill_worker = prefill.worker_id
        try:
            result = await self.pools.unless_down(
                prefill,
                prefill.handle.prefill.remote(
                    PrefillRequest(
                        rid,
                        request.prompt_token_ids,
                        request.sampling_params,
                        endpoint,
                        command.reservation.block_ids,
                        command.reservation.num_cached_tokens,
                        self.pools.router,
                    )
                ),
            )
        except RayActorError as exc:
            self.pools.mark_down(prefill, exc)
            log.warning("prefill worker %s died during %s", prefill.worker_id, rid)
            return flow.on_prefill_failed(prefill.worker_id, died=True, now=time.monotonic())
        except RayError as exc:
            log.warning("remote prefill of %s failed (%s); prefilling on %s", rid, exc, decode.worker_id)
            return flow.on_prefill_failed(prefill.worker_id, died=False, now=time.monotonic())
        finally:
            stream.prefill_worker = None
        return flow.on_prefill_done(result, time.monotonic())

    def _worker(self, worker_id: str) -> PoolWorker:
        w = self.pools.get(worker_id)
        if w is None:  # removed from the pools while the request was on it
            raise WorkerLost(worker_id, f"worker {worker_id} was removed")
        return w

    async def _call(self, w: PoolWorker, ref):
        try:
            return await self.pools.unless_down(w, ref)
        except RayActorError as exc:
            self.pools.mark_down(w, exc)
            if w.role is Role.DECODE:
                raise WorkerLost(w.worker_id, f"decode worker {w.worker_id} died: {exc}") from exc
            raise BackendError(f"{w.role} worker {w.worker_id} died: {exc}", retryable=True) from exc

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

    # ---- aborts ------------------------------------------------------------------------------
    def _abort_in_background(self, request_id: str, command: Abort) -> None:
        w = self.pools.get(command.worker_id)
        if w is not None and not w.gone:
            asyncio.get_running_loop().create_task(self._abort_quietly(w, request_id, command.final))

    async def _abort_quietly(self, w: PoolWorker, request_id: str, final: bool) -> None:
        if final:
            # A creation RPC still in flight would otherwise land after the abort and keep its blocks.
            creating = self._creating.pop(request_id, None)
            if creating is not None:
                try:
                    await asyncio.wait_for(asyncio.ensure_future(creating), self.pools.health_timeout_s)
                except Exception:
                    pass  # failed, hung or not awaitable twice: the abort below still goes out
        if not w.alive:
            return  # a dead worker holds nothing any more
        try:
            await asyncio.wait_for(w.handle.abort.remote(request_id, final), self.pools.health_timeout_s)
        except (RayError, asyncio.TimeoutError):
            pass  # dead or hung: it holds nothing we can free from here

    async def abort(self, request_id: str) -> None:
        self.pools.forget_route(request_id)  # aborted before it started: its route no longer counts as queued
        stream = self.pools.stream_of(request_id)
        if stream is None:
            return
        for wid in [stream.decode_worker] + ([stream.prefill_worker] if stream.prefill_worker else []):
            w = self.pools.get(wid)
            if w is not None:
                await self._abort_quietly(w, request_id, final=True)
