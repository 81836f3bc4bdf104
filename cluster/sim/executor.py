"""The simulated router's executor: each request's `router.flow.RequestFlow`, its commands carried
out as calls to simulated workers, and what the workers say fed back to it.

`FlowExecutor` is to the simulation what `router.ray_backend.RayBackend` is to a real deployment:
it runs the router's own flow and makes the same calls with the same records
(`common.worker_api.WorkerAPI` on `cluster.sim.engine.SimWorker`); only how long things take is
the simulation's. A call reaches its worker half an RPC after it is made and runs between two of
the worker's steps; its answer reaches the flow half an RPC later. A worker's outbox is read
`stream_s` after it fills (the router's long-poll), and every item goes to its request's flow.
Losses (a killed worker, a drain past its timeout) reach the flows through `worker_lost`, ends
from outside (the client gone, a deadline) through `end`, as the router's pools and HTTP layer
deliver them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from operator import methodcaller
from typing import Any

from cluster.sim.costs import ServingOverheads
from cluster.sim.engine import SimWorker
from cluster.sim.events import EventLoop
from cluster.sim.metrics import ItlSample, RequestRecord
from cluster.sim.workload import SimRequest
from common.protocol import RequestOutput
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
from common.transports import KVLoadFailed
from router.backend import RouteDecision
from router.flow import FlowLimits, RequestFlow, WorkerPicker
from router.flow_commands import (
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
from router.trace import RequestTrace

__all__ = ["Flight", "FlowExecutor"]

WAIT_S = 0.1  # a request waiting for a decode worker asks again this often (RayBackend's pace)


@dataclass
class Flight:
    """One request in the simulated router: what every worker call carries, its record, its flow,
    and what to call when it ends."""

    req: SimRequest
    request: WorkerRequest
    rec: RequestRecord
    on_done: Callable[[], None]
    flow: RequestFlow | None = None


def worker_request(req: SimRequest, model: str = "") -> WorkerRequest:
    """A simulated request as the router's edge makes it: its context (under its LoRA adapter, whose
    name is then its `model`, as router.serving names it; the KV namespace follows the adapter),
    prompt and sampling (greedy, exactly `output_len` tokens)."""
    params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
    context = RequestContext(
        req.request_id, model=req.adapter or model, adapter=req.adapter, priority=req.priority, tenant=req.tenant
    )
    return WorkerRequest(context, list(req.prompt), params)


class FlowExecutor:
    def __init__(
        self,
        loop: EventLoop,
        workers: dict[str, SimWorker],
        overheads: ServingOverheads,
        picker: WorkerPicker,
        set_queued: Callable[[str, int], None],
        on_end: Callable[[Flight], None],
        limits: FlowLimits | None = None,
        record_itl: bool = True,
    ) -> None:
        self.loop = loop
        self.workers = workers
        self.overheads = overheads
        self.picker = picker
        self.set_queued = set_queued
        self.on_end = on_end
        self.limits = limits or FlowLimits()
        self.record_itl = record_itl
        self.flights: dict[str, Flight] = {}
        self.counters: dict[str, int] = {}
        self.itl = ItlSample()
        self.migration_gaps: list[float] = []
        # Tests and studies watch every handler's commands: (request id, handler, state after, commands).
        self.observe: Callable[[str, str, RequestFlow, list[Command]], None] | None = None

    # ---- requests in and out -----------------------------------------------------------------
    def start(self, f: Flight, route: RouteDecision) -> None:
        """The route is chosen: the request's flow starts."""
        rid = f.request.request_id
        self.flights[rid] = f
        trace = RequestTrace(rid, len(f.req.prompt))
        f.flow = RequestFlow(f.request.context, len(f.req.prompt), route, self.picker, trace, self.limits)
        self._handle(f, "start", f.flow.start)

    def end(self, request_id: str, reason: EndReason = EndReason.CLIENT_GONE) -> None:
        """End a request from outside its flow (the client went away, or its deadline passed)."""
        f = self.flights.get(request_id)
        if f is None or f.flow is None:
            return
        flow = f.flow
        if reason is EndReason.DEADLINE:
            self._handle(f, "on_deadline", flow.on_deadline)
        else:
            self._handle(f, "on_client_gone", flow.on_client_gone)
        f.rec.failed = f.rec.failed or reason.value
        self._end(f)

    def worker_lost(self, worker_id: str, failure: bool = True) -> None:
        """Tell the requests on the worker it died (`failure`) or is being drained, as the router's
        health loop or a drain does."""
        for f in list(self.flights.values()):
            flow = f.flow
            if flow is not None and worker_id in flow.workers():
                self._handle(f, "on_worker_lost", partial(flow.on_worker_lost, worker_id, failure))

    def on_worker(self, worker_id: str) -> list[str]:
        """The requests on the worker now."""
        return [rid for rid, f in self.flights.items() if f.flow is not None and worker_id in f.flow.workers()]

    # ---- the flow's commands, carried out as events ------------------------------------------
    def _handle(self, f: Flight, name: str, handler: Callable[[float], list[Command]]) -> None:
        """An outcome reached the router: ask the flow what next, and do it."""
        flow = f.flow
        assert flow is not None
        if flow.done and name != "start":
            return
        commands = handler(self.loop.now)
        if self.observe is not None:
            self.observe(flow.request_id, name, flow, commands)
        self._execute(f, commands)

    def _answer(self, f: Flight, name: str, handler: Callable[[float], list[Command]]) -> None:
        """The handler runs half an RPC from now (a call's answer on its way back)."""
        self.loop.after(self.overheads.rpc_s / 2, self._handle, f, name, handler)

    def _execute(self, f: Flight, commands: list[Command]) -> None:
        flow = f.flow
        assert flow is not None
        request, rid = f.request, f.request.request_id
        for c in commands:
            if isinstance(c, Emit):
                self._client_token(f, c.output.finished)
            elif isinstance(c, QueueTokens):
                self.set_queued(c.worker_id, c.delta)
            elif isinstance(c, Count):
                self.counters[c.name] = self.counters.get(c.name, 0) + c.n
            elif isinstance(c, MigrationGap):
                self.migration_gaps.append(c.seconds)
            elif isinstance(c, Reserve):
                reserve = methodcaller("reserve", ReserveRequest(request, RequestOwner(None, c.attempt)))
                self._call(f, c.worker_id, reserve, "on_reserved", flow.on_reserved)
            elif isinstance(c, Prefill):
                endpoint = self.workers[c.decode_worker].endpoint()
                blocks, cached = c.reservation.block_ids, c.reservation.num_cached_tokens
                self._call(f, c.worker_id, methodcaller("prefill", PrefillRequest(request, endpoint, blocks, cached)))
            elif isinstance(c, StartDecode):
                start = StartDecodeRequest(rid, c.first_token, c.kv_namespace)
                self._call(f, c.worker_id, methodcaller("start_decode", start))
            elif isinstance(c, Submit):
                submit = methodcaller("submit", SubmitRequest(request, RequestOwner(None, c.attempt), c.resume))
                self._call(f, c.worker_id, submit, refused=flow.on_submit_refused)
            elif isinstance(c, Abort):
                self._call(f, c.worker_id, methodcaller("abort", AbortRequest(rid, c.final)))
            elif isinstance(c, Fail):
                f.rec.failed = c.message
                self._end(f)
            elif isinstance(c, WaitForDecode):
                self.loop.after(WAIT_S, self._handle, f, "on_wait", flow.on_wait)
            else:
                raise AssertionError(f"no executor for {c!r}")

    def _call(
        self,
        f: Flight,
        worker_id: str,
        fn: Callable[[SimWorker], Any],
        answer_name: str | None = None,
        answer: Callable[[Any, float], list[Command]] | None = None,
        refused: Callable[[str, str, float], list[Command]] | None = None,
    ) -> None:
        """Call the worker (between its steps, half an RPC from now); its answer, or its failure,
        goes back to the flow half an RPC later: a refusal (ValueError) to `refused` (worker id,
        message), else to `on_error`. A worker that died meanwhile answers nothing: its loss reaches
        the flow through `worker_lost`."""
        flow = f.flow
        assert flow is not None

        def run() -> None:
            w = self.workers.get(worker_id)
            if w is None or w.dead:
                return
            try:
                result = fn(w)
            except KVLoadFailed as exc:  # --kv-load-failure-policy fail: D freed it
                self._answer(f, "on_kv_load_failed", partial(flow.on_kv_load_failed, worker_id, exc.reason))
                return
            except ValueError as exc:  # refused (a request id in use, a context it cannot hold)
                if refused is not None:
                    self._answer(f, "refused", partial(refused, worker_id, str(exc)))
                else:
                    self._answer(f, "on_error", partial(flow.on_error, f"{worker_id}: {exc}"))
                return
            if answer is not None and answer_name is not None:
                self._answer(f, answer_name, partial(answer, result))

        w = self.workers.get(worker_id)
        if w is not None and not w.dead:
            self.loop.after(self.overheads.rpc_s / 2, w.call, run)

    # ---- what the workers say ----------------------------------------------------------------
    def outputs_ready(self, w: SimWorker) -> None:
        """A worker's outbox filled: the router's long-poll reads it `stream_s` from now."""
        self.loop.after(self.overheads.stream_s, self._pump, w)

    def _pump(self, w: SimWorker) -> None:
        if w.dead:
            return
        worker_id, now = w.worker_id, self.loop.now
        for item in w.poll_outputs():
            f = self.flights.get(item.request_id)
            if f is None or f.flow is None or f.flow.done:
                continue
            flow = f.flow
            if type(item) is RequestOutput and self.observe is None:
                commands = flow.on_output(worker_id, item, now)
                if len(commands) == 1 and type(commands[0]) is Emit:  # a token and nothing else: most of them
                    self._client_token(f, commands[0].output.finished)
                else:
                    self._execute(f, commands)
            else:
                self._handle(f, "on_worker_output", partial(flow.on_worker_output, worker_id, item))

    def _client_token(self, f: Flight, finished: bool) -> None:
        rec, now = f.rec, self.loop.now
        if rec.first_token_s is None:
            rec.first_token_s = now
        elif self.record_itl:
            self.itl.add(now - rec.last_token_s)
        rec.tokens += 1
        rec.last_token_s = now
        if finished:
            rec.done_s = now
            self._end(f)

    def _end(self, f: Flight) -> None:
        if self.flights.pop(f.request.request_id, None) is None:
            return  # ended already
        flow = f.flow
        if flow is not None:
            trace = flow.trace
            f.rec.cached_tokens, f.rec.prefill_worker = trace.cached_tokens, trace.prefill_worker
            f.rec.decode_worker = flow.decode_worker or f.rec.decode_worker
            f.rec.migrations = flow.moves
            if flow.end_reason is not None:
                f.rec.end_reason = flow.end_reason.value
            if trace.fell_back_to_local:
                f.rec.route = "remote_prefill_fallback_local"
        self.on_end(f)
