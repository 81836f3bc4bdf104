"""The serving backend over Ray actor pools: carries out each request's `router.flow.RequestFlow`
as calls to the workers.

The flow decides (reserve on D, prefill on P, start decoding, resubmit after a migration, abort);
this module only makes the calls through each worker's typed client, turns their answers and
failures into the flow's events, and passes its outputs on. What the workers produce (decoded
tokens, prefills' outcomes) comes back through one long-poll loop per worker that carries every
request's items at once into the request's inbox (router.pools, which also owns the workers'
health, the prefix index's KV events, and adding and draining workers at runtime).

A request is a `router.requests.LiveRequest` from `generate` to its end: its flow, its pending
commands, its inbox. Ending it from outside (`abort`: the client left, or its deadline passed)
is a handler of the flow like any other, whose commands run here at once; the run then finds
its flow ended and stops.

What is Ray's alone stays here: a call to a worker that Ray is restarting is abandoned when the
health loop marks the worker down (`WorkerPools.unless_down`), and a call that creates a
request's state on a decode worker is kept (`LiveRequest.creating`) until it returns, because
the worker is a threaded actor that may run a later abort first (a final abort waits for it,
else a reservation made after its abort would hold blocks forever).

Imports ray but never torch: worker-side objects (KV endpoints included) cross as the torch-free
dataclasses of common.protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from ray.exceptions import RayActorError, RayError

from common.lora import LoRAModuleSpec
from common.protocol import GrammarCompileError, RequestOutput
from common.request import (
    AbortRequest,
    PrefillRequest,
    RequestOwner,
    ReserveRequest,
    StartDecodeRequest,
    SubmitRequest,
)
from common.roles import Role
from common.transports import KVLoadFailed
from router.backend import BackendError, GenerateRequest, WorkerInfo
from router.flow import FlowLimits, RequestFlow
from router.flow_commands import (
    COUNTERS,
    Abort,
    Command,
    Count,
    Emit,
    EndReason,
    Fail,
    MigrationGap,
    Prefill,
    QueueTokens,
    Reserve,
    StartDecode,
    Submit,
    WaitForDecode,
)
from router.migration import WorkerLost
from router.pools import PoolWorker, WorkerPools
from router.prefix_index import PrefixIndex
from router.requests import CallFailed, Delivered, Ended, InboxEvent, LiveRequest

__all__ = ["RayBackend"]

log = logging.getLogger("baton.router")

# Commands that only count: run at once when a request starts, so a burst of requests routed in
# one go sees each other's prompts as queued work (each starts when the event loop comes to it).
_BOOKKEEPING = (QueueTokens, Count)


class RayBackend:
    """`router.backend.ServingBackend` over `WorkerPools` of Ray actors."""

    def __init__(self, pools: WorkerPools, limits: FlowLimits | None = None) -> None:
        self.pools = pools
        self.limits = limits or FlowLimits()
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Seconds from losing a request's decode worker to its next token on the new one (bounded).
        self.migration_gaps: deque[float] = deque(maxlen=1000)
        self._tasks: set[asyncio.Task] = set()  # calls running beside their request (held: not collected)

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.pools.prefix_index

    def workers(self) -> list[WorkerInfo]:
        return self.pools.workers()

    async def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        """Every live worker of both pools reads the adapter: a prefill worker must never prefill a
        request under the base model because it lacked the adapter."""
        try:
            await self.pools.on_every_worker(lambda client: client.load_lora_adapter(spec))
        except Exception:
            # One worker refused: none keeps it (a worker that took it would list it as served).
            try:
                await self.pools.on_every_worker(lambda client: client.unload_lora_adapter(spec.name))
            except Exception:
                log.warning("could not unload LoRA adapter %r after a refused load", spec.name, exc_info=True)
            raise
        finally:
            await self.pools.refresh_stats()  # this router lists and routes by what the workers now serve

    async def unload_lora_adapter(self, name: str) -> None:
        await self.pools.on_every_worker(lambda client: client.unload_lora_adapter(name))
        await self.pools.refresh_stats()

    def routers(self) -> dict:
        """This router's id and every router holding a lease on some worker (for /v1/status)."""
        return {"this": self.pools.router.router_id, "leases": self.pools.router_leases()}

    async def close(self) -> None:
        await self.pools.close()

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        flow = RequestFlow(
            request.context, len(request.prompt_token_ids), request.route, self.pools, request.trace, self.limits
        )
        live = LiveRequest(flow, request.request)
        self.pools.requests.open(live)
        live.pending.extend(flow.start(time.monotonic()))
        while live.pending and isinstance(live.pending[0], _BOOKKEEPING):
            self._bookkeep(live.pending.popleft())
        return self._run(live)

    async def _run(self, live: LiveRequest) -> AsyncGenerator[RequestOutput, None]:
        flow, pending = live.flow, live.pending
        try:
            self.pools.ensure_started()
            while not flow.done or pending:
                if not pending:
                    pending.extend(self._on_event(live, await live.inbox.get()))
                    continue
                command = pending.popleft()
                if isinstance(command, Emit):
                    yield command.output
                elif isinstance(command, Fail):
                    raise _error_of(command)
                else:
                    try:
                        pending.extend(await self._execute(live, command))
                    except WorkerLost as lost:
                        pending.clear()  # the rest of the batch assumed the worker it just lost
                        now = time.monotonic()
                        pending.extend(flow.on_worker_lost(lost.worker_id, lost.failure, now, lost.attempt))
        finally:
            self.pools.requests.close(flow.request_id)
            # A consumer that closes the stream at its finished output leaves the commands after
            # that Emit unrun (a finished first token's Abort of D's reservation is one of them);
            # one that goes away (or a failure) ends the request: free its blocks in both pools.
            # Tasks, because this may run while the generator closes.
            self._run_beside(live, [*_leftover(pending), *flow.on_client_gone(time.monotonic())])

    async def abort(self, request_id: str, reason: EndReason = EndReason.CLIENT_GONE) -> None:
        """End the request from outside its run (the client left, or its deadline passed): the
        flow's handler frees what it holds, here and now; its run wakes and stops."""
        live = self.pools.requests.get(request_id)
        if live is None:
            return
        flow, now = live.flow, time.monotonic()
        ending = flow.on_deadline(now) if reason is EndReason.DEADLINE else flow.on_client_gone(now)
        commands = [*_leftover(live.pending), *ending]
        live.pending.clear()
        self.pools.requests.close(request_id)
        live.inbox.put_nowait(Ended())
        for command in commands:
            if isinstance(command, _BOOKKEEPING):
                self._bookkeep(command)
        aborts = [c for c in commands if isinstance(c, Abort)]
        await asyncio.gather(*(self._abort_quietly(live, c) for c in aborts))

    # ---- events ------------------------------------------------------------------------------
    def _on_event(self, live: LiveRequest, event: InboxEvent) -> list[Command]:
        flow, now = live.flow, time.monotonic()
        if isinstance(event, Delivered):
            return flow.on_worker_output(event.worker_id, event.item, now)
        if isinstance(event, WorkerLost):
            return flow.on_worker_lost(event.worker_id, event.failure, now, event.attempt)
        if isinstance(event, CallFailed):
            if not flow.current(event.worker_id, event.attempt):
                return []  # a call of an attempt the request has left
            return self._failed(flow, event.worker_id, event.error)
        assert isinstance(event, Ended)
        return []

    def _failed(self, flow: RequestFlow, worker_id: str, error: BaseException) -> list[Command]:
        """A call to `worker_id` failed: what the flow makes of it, by what the worker raised."""
        now = time.monotonic()
        if isinstance(error, WorkerLost):
            return flow.on_worker_lost(error.worker_id, error.failure, now, error.attempt)
        cause = getattr(error, "cause", None)
        if isinstance(cause, KVLoadFailed):  # --kv-load-failure-policy fail: D freed it
            return flow.on_kv_load_failed(worker_id, cause.reason, now)
        if isinstance(cause, GrammarCompileError):  # raised before the worker held anything
            return flow.on_bad_input(str(cause), now)
        return flow.on_error(f"a call to {worker_id} failed: {error}", now)

    # ---- commands ----------------------------------------------------------------------------
    async def _execute(self, live: LiveRequest, command: Command) -> list[Command]:
        """Carry out one command; returns the flow's answer to its outcome (or nothing)."""
        flow, rid = live.flow, live.flow.request_id
        if isinstance(command, (Count, QueueTokens)):
            self._bookkeep(command)
        elif isinstance(command, MigrationGap):
            self.migration_gaps.append(command.seconds)
        elif isinstance(command, Reserve):
            decode = self._worker(command.worker_id)
            owner = RequestOwner(self.pools.router, command.attempt)
            try:
                reservation = await self._create_on(
                    live, decode, decode.client.reserve(ReserveRequest(live.request, owner))
                )
            except RayError as exc:
                return self._failed(flow, decode.worker_id, exc)
            return flow.on_reserved(reservation, time.monotonic())
        elif isinstance(command, Prefill):
            return await self._prefill(live, command)
        elif isinstance(command, StartDecode):
            decode = self._worker(command.worker_id)
            ref = decode.client.start_decode(StartDecodeRequest(rid, command.first_token, command.kv_namespace))
            live.creating = ref  # not awaited here: the client has its first token before D's step ends
            self._beside(self._watch_start(live, decode, ref, flow.moves))
        elif isinstance(command, Submit):
            if flow.moves:
                moved = len(flow.output_token_ids)
                log.warning("request %s moves to %s after %d tokens", rid, command.worker_id, moved)
            decode = self._worker(command.worker_id)
            submit = SubmitRequest(live.request, RequestOwner(self.pools.router, command.attempt), command.resume)
            try:
                await self._create_on(live, decode, decode.client.submit(submit))
            except RayError as exc:  # refused (a bug, or a worker that cannot hold the context), or bad input
                if isinstance(getattr(exc, "cause", None), GrammarCompileError):
                    return self._failed(flow, decode.worker_id, exc)
                return flow.on_submit_refused(command.worker_id, str(exc), time.monotonic())
        elif isinstance(command, Abort):
            if not command.wait:
                self._run_beside(live, [command])
                return []
            w = self.pools.get(command.worker_id)
            if w is not None:
                try:
                    await self._call(w, w.client.abort(AbortRequest(rid, command.final)))
                except WorkerLost:
                    raise
                except (RayError, BackendError):
                    pass  # a dead prefill worker, or a refusal: it holds nothing we can free
        elif isinstance(command, WaitForDecode):
            await asyncio.sleep(min(0.1, self.pools.health_interval_s))
            return flow.on_wait(time.monotonic())
        else:
            raise AssertionError(f"no executor for {command!r}")
        return []

    async def _prefill(self, live: LiveRequest, command: Prefill) -> list[Command]:
        """Queue the prompt on P; its outcome arrives from P's outbox (or P is found lost)."""
        flow = live.flow
        decode, prefill = self._worker(command.decode_worker), self.pools.get(command.worker_id)
        if prefill is None:  # removed from its pool since the route was chosen
            return flow.on_prefill_failed(command.worker_id, died=True, now=time.monotonic())
        endpoint = await self._call(decode, self.pools.endpoint(decode))
        reservation = command.reservation
        request = PrefillRequest(
            live.request,
            endpoint,
            reservation.block_ids,
            reservation.num_cached_tokens,
            RequestOwner(self.pools.router),
        )
        try:
            await self.pools.unless_down(prefill, prefill.client.prefill(request))
        except RayActorError as exc:
            self.pools.mark_down(prefill, exc)
            log.warning("prefill worker %s died during %s", prefill.worker_id, flow.request_id)
            return flow.on_prefill_failed(prefill.worker_id, died=True, now=time.monotonic())
        except RayError as exc:
            if isinstance(getattr(exc, "cause", None), GrammarCompileError):
                return self._failed(flow, prefill.worker_id, exc)
            log.warning("remote prefill of %s failed (%s); prefilling on %s", flow.request_id, exc, decode.worker_id)
            return flow.on_prefill_failed(prefill.worker_id, died=False, now=time.monotonic())
        return []

    async def _watch_start(self, live: LiveRequest, w: PoolWorker, ref: Any, attempt: int) -> None:
        """Await D's start_decode beside the request: its failure reaches the request as an event."""
        try:
            await self._call(w, ref)
        except WorkerLost as lost:
            live.inbox.put_nowait(WorkerLost(lost.worker_id, str(lost), lost.failure, attempt))
        except Exception as exc:  # whatever it is, the request hears of it rather than wait for ever
            live.inbox.put_nowait(CallFailed(w.worker_id, exc, attempt))
        finally:
            if live.creating is ref:
                live.creating = None

    def _bookkeep(self, command: Command) -> None:
        if isinstance(command, Count):
            self.counters[command.name] += command.n
        elif isinstance(command, QueueTokens):
            self.pools.queue_tokens(command.worker_id, command.delta)

    def _worker(self, worker_id: str) -> PoolWorker:
        w = self.pools.get(worker_id)
        if w is None:  # removed from the pools while the request was on it
            raise WorkerLost(worker_id, f"worker {worker_id} was removed")
        return w

    async def _call(self, w: PoolWorker, ref: Any) -> Any:
        try:
            return await self.pools.unless_down(w, ref)
        except RayActorError as exc:
            self.pools.mark_down(w, exc)
            if w.role is Role.DECODE:
                raise WorkerLost(w.worker_id, f"decode worker {w.worker_id} died: {exc}") from exc
            raise BackendError(f"{w.role} worker {w.worker_id} died: {exc}", retryable=True) from exc

    async def _create_on(self, live: LiveRequest, w: PoolWorker, ref: Any) -> Any:
        """Await a call creating the request's state on `w`; cancelled, it stays `live.creating`."""
        live.creating = ref
        try:
            result = await self._call(w, ref)
        except asyncio.CancelledError:
            raise  # the abort that follows waits for the call, then frees what it made
        except BaseException:
            live.creating = None
            raise
        live.creating = None
        return result

    # ---- what runs beside a request --------------------------------------------------------------
    def _beside(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _run_beside(self, live: LiveRequest, commands: list[Command]) -> None:
        """Bookkeeping at once, aborts as tasks (errors ignored: a dead worker holds nothing)."""
        for command in commands:
            if isinstance(command, Abort):
                w = self.pools.get(command.worker_id)
                if w is not None and not w.gone:
                    self._beside(self._abort_quietly(live, command))
            else:
                self._bookkeep(command)

    async def _abort_quietly(self, live: LiveRequest, command: Abort) -> None:
        w = self.pools.get(command.worker_id)
        if w is None:
            return
        if command.final and live.creating is not None:
            # A creation call still in flight would otherwise land after the abort and keep its blocks.
            creating, live.creating = live.creating, None
            try:
                await asyncio.wait_for(asyncio.ensure_future(creating), self.pools.health_timeout_s)
            except Exception:
                pass  # failed, hung or not awaitable twice: the abort below still goes out
        if not w.alive:
            return  # a dead worker holds nothing any more
        try:
            request = AbortRequest(live.flow.request_id, command.final)
            await asyncio.wait_for(w.client.abort(request), self.pools.health_timeout_s)
        except (RayError, asyncio.TimeoutError):
            pass  # dead or hung: it holds nothing we can free from here


def _leftover(pending: deque[Command]) -> list[Command]:
    """The commands of a batch that must run however the request ends: frees and bookkeeping."""
    return [c for c in pending if isinstance(c, (Abort, QueueTokens, Count))]


def _error_of(command: Fail) -> Exception:
    """What the HTTP layer is told of a failed request: bad input a worker found is the field's
    400 (router.serving names it), anything else a BackendError (503 when retryable, else 500)."""
    if command.reason is EndReason.BAD_INPUT:
        return GrammarCompileError(command.message)
    return BackendError(command.message, reason=command.reason)
