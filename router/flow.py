"""One request's trip across the two pools, as a state machine that does no I/O.

`RequestFlow` owns a request as the router sees it, from the moment it is routed to its end: where
it is (`FlowState`), which moves are legal (`TRANSITIONS`, checked on every move as
`workers.engine.sequence` checks a sequence's), which workers it is on, what the client already
has, and why it ended (`end_reason`). Each handler takes what happened and the time, updates the
flow and returns the commands to carry out, in order (router.flow_commands). Two executors carry
them out: `router.ray_backend.RayBackend` as calls to Ray actors, `cluster.sim.simulator.Simulator`
as events on simulated workers. Neither keeps a lifecycle of its own, so a new piece of
per-request state is written here once.

Remote prefill:  ROUTED -> RESERVING (D sets blocks aside) -> PREFILLING (P computes the prompt and
pushes its KV into them) -> DECODING (first token to the client; D decodes on) -> FINISHED.
Local prefill:   ROUTED -> DECODING (D runs the whole request) -> FINISHED.
Healing: D lost while the request is on it -> MIGRATING (wait for a live decode worker, up to
`migration_wait_s`) -> DECODING on the new worker from prompt + the tokens already streamed, at
most `max_migrations` times (a drain moves without counting); P lost or failed -> RESERVING again
with another prefill worker, or D prefills itself.

Every exit is a handler and ends in a terminal state with its `EndReason`: the client gone
(`on_client_gone`: ABORTED), the deadline (`on_deadline`), bad input a worker found
(`on_bad_input`), a KV handoff that failed under the `fail` policy (`on_kv_load_failed`), a refusal
(`on_submit_refused`), an unexpected call failure (`on_error`), no worker to go on with: all FAILED.
Every end frees the request's blocks in both pools.

Outputs and losses arrive from the workers in any order and may be stale (a worker the request
left, an earlier attempt on the same worker): the handlers drop what is not from the worker the
request is on now, and only then check the table.

Times are whatever clock the executor runs on (the router's monotonic clock, or simulated time):
the flow only subtracts them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from common.protocol import KVReservation, PrefillFailed, PrefillResult, RequestOutput, ResumeState, WorkerOutput
from common.request import RequestContext
from common.roles import Role
from router.backend import RouteDecision
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

__all__ = ["TERMINAL", "TRANSITIONS", "FlowLimits", "FlowState", "IllegalTransition", "RequestFlow", "WorkerPicker"]


class FlowState(enum.Enum):
    ROUTED = "routed"  # a decode worker is chosen; nothing sent yet
    RESERVING = "reserving"  # D is setting blocks aside for P's KV
    PREFILLING = "prefilling"  # P computes the prompt and pushes its KV into D's blocks
    DECODING = "decoding"  # D produces the stream (a local prefill included)
    MIGRATING = "migrating"  # D was lost: waiting for a decode worker to continue on
    FINISHED = "finished"
    ABORTED = "aborted"  # the client went away
    FAILED = "failed"  # anything that cannot go on (end_reason says what)


_S = FlowState
_ANY_END = frozenset({_S.ABORTED, _S.FAILED})
TRANSITIONS: dict[FlowState, frozenset[FlowState]] = {
    _S.ROUTED: frozenset({_S.RESERVING, _S.DECODING}) | _ANY_END,
    _S.RESERVING: frozenset({_S.PREFILLING, _S.DECODING, _S.MIGRATING}) | _ANY_END,
    # RESERVING again: P was lost, another one prefills into a fresh reservation.
    _S.PREFILLING: frozenset({_S.RESERVING, _S.DECODING, _S.FINISHED, _S.MIGRATING}) | _ANY_END,
    _S.DECODING: frozenset({_S.FINISHED, _S.MIGRATING}) | _ANY_END,
    _S.MIGRATING: frozenset({_S.DECODING, _S.MIGRATING}) | _ANY_END,
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
    _S.FAILED: frozenset(),
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class IllegalTransition(AssertionError):
    """A handler tried a move the table does not allow: a bug in the flow or its executor."""


class WorkerPicker(Protocol):
    """What the flow asks of the pools when the routing policy is not asked again (a fallback
    prefill worker, a migration target)."""

    def usable(self, worker_id: str) -> bool:
        """Alive and taking new requests."""
        ...

    def pick(self, role: Role, exclude: frozenset[str], context: RequestContext | None = None) -> str | None:
        """The least busy usable worker of the pool outside `exclude` that can serve `context`
        (its LoRA adapter: router.routing.able_workers), or None."""
        ...


@dataclass(frozen=True)
class FlowLimits:
    max_migrations: int = 3  # failed decode workers a request survives
    migration_wait_s: float = 30.0  # how long a lost request waits for a decode worker

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.migration_wait_s >= 0:
            raise ValueError(f"migration_wait_s must be >= 0, got {self.migration_wait_s}")


@dataclass
class RequestFlow:
    context: RequestContext
    prompt_len: int
    route: RouteDecision
    picker: WorkerPicker
    trace: RequestTrace
    limits: FlowLimits = field(default_factory=FlowLimits)
    state: FlowState = FlowState.ROUTED
    end_reason: EndReason | None = None
    error: str | None = None
    decode_worker: str | None = None
    prefill_worker: str | None = None  # the one prefilling now (None outside RESERVING/PREFILLING)
    tried_prefill: set[str] = field(default_factory=set)
    output_token_ids: list[int] = field(default_factory=list)  # what the client has
    text_chars: int = 0
    migrations: int = 0  # failed decode workers so far
    moves: int = 0  # every move, drains included: the attempt that outputs must carry
    # Prompt tokens counted as queued prefill work on `queued_on` until the first token.
    queued_on: str | None = None
    queued: int = 0
    _started_at: float = 0.0
    _submitted_at: float = 0.0  # a local prefill's submit (its prefill time runs to the first output)
    _sent_at: float = 0.0  # a remote prefill's call
    _lost_at: float | None = None
    _lost_worker: str | None = None
    _wait_until: float = 0.0

    @property
    def request_id(self) -> str:
        return self.context.request_id

    # ---- the table -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def current(self, worker_id: str, attempt: int) -> bool:
        """Whether `worker_id` under `attempt` is where the request decodes now: what a worker says
        of an earlier attempt (one the request left, or the same worker before a restart) is stale."""
        return worker_id == self.decode_worker and attempt == self.moves and not self.done

    def workers(self) -> tuple[str, ...]:
        """The workers the request is on now (what an abort must free)."""
        return tuple(w for w in (self.decode_worker, self.prefill_worker) if w is not None) if not self.done else ()

    def _move(self, new: FlowState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.name} -> {new.name} is not allowed")
        self.state = new

    def _expect(self, handler: str, *states: FlowState) -> None:
        if self.state not in states:
            raise IllegalTransition(
                f"request {self.request_id}: {handler} in state {self.state.name} "
                f"(expected {' or '.join(s.name for s in states)})"
            )

    def resume_state(self) -> ResumeState | None:
        """What the next decode worker continues from (None: nothing streamed yet, start afresh)."""
        if not self.output_token_ids:
            return None
        return ResumeState(tuple(self.output_token_ids), self.text_chars)

    # ---- the request's way through the pools ----------------------------------------------------
    def start(self, now: float) -> list[Command]:
        """The route was chosen a moment ago; its workers may have died or started draining since."""
        self._expect("start", FlowState.ROUTED)
        self._started_at = now
        picker = self.picker
        route = self.route
        decode = (
            route.decode_worker
            if picker.usable(route.decode_worker)
            else picker.pick(Role.DECODE, frozenset(), self.context)
        )
        if decode is None:
            return self._fail("no live decode worker", EndReason.NO_WORKER)
        self.decode_worker = decode
        self.trace.decode_worker = decode
        self.queued_on, self.queued = route.prefill_worker or decode, self.prompt_len
        commands: list[Command] = [QueueTokens(self.queued_on, self.queued)]
        if route.prefill_worker is None:
            return commands + self._submit_locally(now)
        prefill = (
            route.prefill_worker
            if picker.usable(route.prefill_worker)
            else picker.pick(Role.PREFILL, frozenset(), self.context)
        )
        if prefill is None:
            self.trace.fell_back_to_local = True
            self.trace.prefill_worker = None
            return commands + self._submit_locally(now)
        return commands + self._reserve(prefill)

    def on_reserved(self, reservation: KVReservation | None, now: float) -> list[Command]:
        """D's answer to Reserve: blocks set aside, or None (no room now: D queues it as a local request).
        A request ended meanwhile (its client left while the call was out) has nothing to do."""
        if self.done:
            return []
        self._expect("on_reserved", FlowState.RESERVING)
        if reservation is None:
            return self._fall_back_to_local(now)
        self._move(FlowState.PREFILLING)
        self._sent_at = now
        assert self.prefill_worker is not None and self.decode_worker is not None
        return [Prefill(self.prefill_worker, self.decode_worker, reservation)]

    def on_worker_output(self, worker_id: str, item: WorkerOutput, now: float) -> list[Command]:
        """Something from a worker's outbox: decoded tokens, or a prefill's outcome."""
        if isinstance(item, RequestOutput):
            return self.on_output(worker_id, item, now)
        if isinstance(item, PrefillResult):
            return self.on_prefill_done(worker_id, item, now)
        assert isinstance(item, PrefillFailed), item
        return self.on_prefill_failed(worker_id, died=False, now=now)

    def on_prefill_done(self, worker_id: str, result: PrefillResult, now: float) -> list[Command]:
        """P prefilled, pushed the KV into D's blocks and sampled the first token."""
        if self.state is not FlowState.PREFILLING or worker_id != self.prefill_worker:
            return []  # a prefill worker the request already left
        assert self.decode_worker is not None
        first = result.output
        trace = self.trace
        trace.queue_s = (self._sent_at - self._started_at) + max(
            0.0, (now - self._sent_at) - result.prefill_seconds - result.transfer_seconds
        )
        trace.prefill_s, trace.transfer_s = result.prefill_seconds, result.transfer_seconds
        trace.kv_bytes, trace.kv_blocks = result.bytes_sent, result.num_blocks_sent
        trace.kv_rank_pairs = result.rank_pairs
        trace.cached_tokens = first.num_cached_tokens
        self.prefill_worker = None
        commands: list[Command] = [
            Count("remote_prefill"),
            Count("kv_blocks_transferred", result.num_blocks_sent),
            Count("kv_bytes_transferred", result.bytes_sent),
            *self._unqueue(),
        ]
        self._record(first)
        if first.finished:
            # Nothing to decode: free the reservation beside the answer, not before it.
            self._end(FlowState.FINISHED, EndReason.FINISHED)
            return commands + [Emit(first), Abort(self.decode_worker, final=True)]
        self._move(FlowState.DECODING)
        start = StartDecode(self.decode_worker, first.token_ids[0], result.kv_namespace)
        return commands + [start, Emit(first)]

    def on_prefill_failed(self, worker_id: str, died: bool, now: float) -> list[Command]:
        """The prefill failed on P: P died (another prefill worker tries, else D prefills), or P
        could not do it (D prefills). D's reservation is freed first either way."""
        if self.state is not FlowState.PREFILLING or worker_id != self.prefill_worker:
            return []
        assert self.decode_worker is not None
        commands: list[Command] = [Count("prefill_fallbacks"), Abort(self.decode_worker, final=False, wait=True)]
        if died:
            retry = self.picker.pick(Role.PREFILL, frozenset(self.tried_prefill), self.context)
            if retry is not None:
                return commands + [Count("prefill_retries")] + self._reserve(retry)
        return commands + self._fall_back_to_local(now)

    def on_output(self, worker_id: str, output: RequestOutput, now: float) -> list[Command]:
        """An increment from a decode worker (dropped unless from the request's current one and attempt)."""
        if self.state is not FlowState.DECODING or not self.current(worker_id, output.attempt):
            return []
        commands: list[Command] = []
        if self.queued:
            commands += self._unqueue()
            self.trace.prefill_s = now - self._submitted_at
            self.trace.cached_tokens = output.num_cached_tokens
        if self._lost_at is not None and output.token_ids:
            commands.append(MigrationGap(now - self._lost_at))
            self._lost_at = None
        self._record(output)
        commands.append(Emit(output))
        if output.finished:
            self._end(FlowState.FINISHED, EndReason.FINISHED)
        return commands

    # ---- healing -------------------------------------------------------------------------------
    def on_worker_lost(self, worker_id: str, failure: bool, now: float, attempt: int | None = None) -> list[Command]:
        """A worker the request is on died, stopped answering (`failure`), or is being drained. A
        prefill worker's loss is a failed prefill; a decode worker's moves the request. `attempt`:
        the request's attempt when the loss was seen (None: now); a loss seen before a move is stale,
        even of the worker the request came back to."""
        if self.done or (attempt is not None and attempt != self.moves):
            return []
        if worker_id == self.prefill_worker and self.state is FlowState.PREFILLING:
            return self.on_prefill_failed(worker_id, died=True, now=now)
        if worker_id != self.decode_worker or self.state in (FlowState.ROUTED, FlowState.MIGRATING):
            return []  # a worker the request already left, or is leaving
        self._expect("on_worker_lost", FlowState.RESERVING, FlowState.PREFILLING, FlowState.DECODING)
        if failure:
            self.migrations += 1
            if self.migrations > self.limits.max_migrations:
                return [Count("migrations_failed")] + self._fail(
                    f"request {self.request_id} lost its decode worker {self.migrations} times (last {worker_id}); "
                    f"giving up after {self.limits.max_migrations} migrations",
                    EndReason.WORKER_LOST,
                )
        self._move(FlowState.MIGRATING)
        self._lost_at = self._lost_at if self._lost_at is not None else now
        self._lost_worker = worker_id
        self._wait_until = now + self.limits.migration_wait_s
        self.prefill_worker = None
        # Whatever the old worker still holds of the request must go (it may only have been slow).
        commands: list[Command] = [Abort(worker_id, final=False)]
        target = self.picker.pick(Role.DECODE, frozenset({worker_id}), self.context)
        if target is None:
            return commands + [WaitForDecode(self._wait_until)]
        return commands + self._continue_on(target)

    def on_drain(self, worker_id: str, now: float) -> list[Command]:
        """The decode worker is being removed: move off it without using a migration attempt."""
        return self.on_worker_lost(worker_id, failure=False, now=now)

    def on_wait(self, now: float) -> list[Command]:
        """A moment after WaitForDecode: is there a decode worker now (the lost one restarted included)?"""
        if self.state is not FlowState.MIGRATING:
            return []  # ended meanwhile
        target = self.picker.pick(Role.DECODE, frozenset(), self.context)
        if target is None:
            if now > self._wait_until:
                return [Count("migrations_failed")] + self._fail(
                    f"request {self.request_id}: decode worker {self._lost_worker} was lost and no decode worker was "
                    f"live within {self.limits.migration_wait_s:.0f} s to continue it",
                    EndReason.WORKER_LOST,
                )
            return [WaitForDecode(self._wait_until)]
        commands: list[Command] = []
        if target == self._lost_worker:
            commands.append(Abort(target, final=False, wait=True))  # back after a restart: free it of the request first
        return commands + self._continue_on(target)

    # ---- the ends that are not a finished answer ---------------------------------------------
    def on_submit_refused(self, worker_id: str, message: str, now: float) -> list[Command]:
        """D refused to run the request (a bug, or a context it cannot hold): no retry helps."""
        if self.done or worker_id != self.decode_worker:
            return []
        self._expect("on_submit_refused", FlowState.DECODING)
        commands: list[Command] = [Count("migrations_failed")] if self.moves else []
        return commands + self._fail(
            f"request {self.request_id} could not run on {worker_id}: {message}", EndReason.REFUSED
        )

    def on_kv_load_failed(self, worker_id: str, reason: str, now: float) -> list[Command]:
        """The KV P pushed to D failed its checks, and D's policy is to fail (D freed the request)."""
        if self.done or worker_id != self.decode_worker:
            return []
        return self._fail(f"the KV transfer of this request failed ({reason}); retry it", EndReason.KV_LOAD_FAILED)

    def on_bad_input(self, message: str, now: float) -> list[Command]:
        """A worker refused the request as bad input before holding anything of it (its structured
        output does not compile there): the client gets a 400 naming the field."""
        return [] if self.done else self._fail(message, EndReason.BAD_INPUT)

    def on_error(self, message: str, now: float) -> list[Command]:
        """A call to a worker failed in a way no handler above covers."""
        return [] if self.done else self._fail(message, EndReason.ERROR)

    def on_deadline(self, now: float) -> list[Command]:
        """The request ran past its deadline (the HTTP layer answered 504)."""
        return [] if self.done else self._fail(f"request {self.request_id} ran past its deadline", EndReason.DEADLINE)

    def on_client_gone(self, now: float) -> list[Command]:
        """The consumer went away (a client disconnect, or the stream closed)."""
        if self.done:
            return []
        commands = self._free_everything()
        self._end(FlowState.ABORTED, EndReason.CLIENT_GONE)
        return commands

    # ---- helpers ---------------------------------------------------------------------------------
    def _end(self, state: FlowState, reason: EndReason) -> None:
        self._move(state)
        self.end_reason = reason

    def _reserve(self, prefill: str) -> list[Command]:
        assert self.decode_worker is not None
        self._move(FlowState.RESERVING)
        self.prefill_worker = prefill
        self.tried_prefill.add(prefill)
        self.trace.prefill_worker = prefill
        return [Reserve(self.decode_worker, self.moves)]

    def _submit_locally(self, now: float) -> list[Command]:
        assert self.decode_worker is not None
        self._move(FlowState.DECODING)
        self._submitted_at = now
        self.trace.queue_s = now - self._started_at
        return [Count("local_prefill"), Submit(self.decode_worker, self.moves)]

    def _fall_back_to_local(self, now: float) -> list[Command]:
        self.prefill_worker = None
        self.trace.fell_back_to_local = True
        self.trace.prefill_worker = None
        return self._submit_locally(now)

    def _continue_on(self, target: str) -> list[Command]:
        self._move(FlowState.DECODING)
        self.moves += 1
        self.decode_worker = target
        self.trace.decode_worker = target
        return [Count("migrations"), Submit(target, self.moves, self.resume_state())]

    def _record(self, output: RequestOutput) -> None:
        self.output_token_ids.extend(output.token_ids)
        self.text_chars += len(output.text)

    def _unqueue(self) -> list[Command]:
        if not self.queued:
            return []
        assert self.queued_on is not None
        commands: list[Command] = [QueueTokens(self.queued_on, -self.queued)]
        self.queued = 0
        return commands

    def _free_everything(self) -> list[Command]:
        commands = self._unqueue()
        commands += [Abort(worker, final=True) for worker in self.workers()]
        return commands

    def _fail(self, message: str, reason: EndReason) -> list[Command]:
        commands = self._free_everything()
        self.error = message
        self._end(FlowState.FAILED, reason)
        return commands + [Fail(message, reason)]
