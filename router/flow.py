"""One request's trip across the two pools, as a state machine that does no I/O.

`RequestFlow` is the only place that knows the lifecycle of a request as the router sees it: where
it is (`FlowState`), which moves are legal (`TRANSITIONS`, checked on every move as
`workers.sequence` checks a sequence's), and what to do next. Each handler (`start`, `on_reserved`,
`on_prefill_done`, `on_prefill_failed`, `on_output`, `on_worker_lost`, `on_drain`, `on_wait`,
`on_submit_refused`, `on_client_gone`) takes what happened and the time, updates the
flow's data and returns the commands to carry out, in order. Two executors carry them out:
`router.ray_backend.RayBackend` as Ray calls to real workers, `cluster.sim.simulator.Simulator` as
events on simulated ones. Neither keeps a lifecycle of its own, so a new piece of per-request state
(a grammar's position, a draft model's KV, a checksum) is written here once.

Remote prefill:  ROUTED -> RESERVING (D sets blocks aside) -> PREFILLING (P computes the prompt and
pushes its KV into them) -> DECODING (first token to the client; D decodes on) -> FINISHED.
Local prefill:   ROUTED -> DECODING (D runs the whole request) -> FINISHED.
Healing: D lost while the request is on it -> MIGRATING (wait for a live decode worker, up to
`migration_wait_s`) -> DECODING on the new worker from prompt + the tokens already streamed, at
most `max_migrations` times (a drain moves without counting); P lost -> RESERVING again with
another prefill worker, or D prefills itself. A client that goes away -> ABORTED; anything that
cannot go on -> FAILED. Every end frees the request's blocks in both pools. A request's deadline
is the HTTP layer's (router.admission): past it the stream is closed, which reaches the flow as
`on_client_gone`; the deadlines of KV transfers are the workers' (a late transfer fails the
prefill call: `on_prefill_failed`).

Times are whatever clock the executor runs on (the router's monotonic clock, or simulated time):
the flow only subtracts them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from common.protocol import KVReservation, PrefillResult, RequestOutput, ResumeState
from common.roles import Role
from router.backend import RouteDecision
from router.trace import RequestTrace

__all__ = [
    "Abort",
    "Command",
    "Count",
    "Emit",
    "Fail",
    "FlowLimits",
    "FlowState",
    "Follow",
    "IllegalTransition",
    "MigrationGap",
    "Prefill",
    "QueueTokens",
    "Reserve",
    "RequestFlow",
    "StartDecode",
    "Submit",
    "TRANSITIONS",
    "WaitForDecode",
    "WorkerPicker",
]


class FlowState(enum.Enum):
    ROUTED = "routed"  # a decode worker is chosen; nothing sent yet
    RESERVING = "reserving"  # D is setting blocks aside for P's KV
    PREFILLING = "prefilling"  # P computes the prompt and pushes its KV into D's blocks
    DECODING = "decoding"  # D produces the stream (a local prefill included)
    MIGRATING = "migrating"  # D was lost: waiting for a decode worker to continue on
    FINISHED = "finished"
    ABORTED = "aborted"  # the client went away
    FAILED = "failed"


_S = FlowState
TRANSITIONS: dict[FlowState, frozenset[FlowState]] = {
    _S.ROUTED: frozenset({_S.RESERVING, _S.DECODING, _S.ABORTED, _S.FAILED}),
    _S.RESERVING: frozenset({_S.PREFILLING, _S.DECODING, _S.MIGRATING, _S.ABORTED, _S.FAILED}),
    # RESERVING again: P was lost, another one prefills into a fresh reservation.
    _S.PREFILLING: frozenset({_S.RESERVING, _S.DECODING, _S.FINISHED, _S.MIGRATING, _S.ABORTED, _S.FAILED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.MIGRATING, _S.ABORTED, _S.FAILED}),
    _S.MIGRATING: frozenset({_S.DECODING, _S.MIGRATING, _S.ABORTED, _S.FAILED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
    _S.FAILED: frozenset(),
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class IllegalTransition(AssertionError):
    """A handler tried a move the table does not allow: a bug in the flow or its executor."""


# ---- commands: what an executor carries out, in the order given ------------------------------------
@dataclass(frozen=True)
class Follow:
    """Take the request's outputs from this decode worker from now on (and from no other), and
    only those of this attempt: the creation calls that follow carry it, the worker stamps it on
    the request's outputs, and whatever an earlier attempt on the same worker left queued (a
    worker that was given up and came back, or restarted) is told apart and dropped."""

    worker_id: str
    attempt: int = 0


@dataclass(frozen=True)
class Reserve:
    """Ask decode worker D to set blocks aside for the prompt; answer with `on_reserved`."""

    worker_id: str


@dataclass(frozen=True)
class Prefill:
    """Prefill on P into D's reserved blocks; answer with `on_prefill_done` or `on_prefill_failed`."""

    worker_id: str
    decode_worker: str
    reservation: KVReservation


@dataclass(frozen=True)
class StartDecode:
    """The KV is on D: let it decode on from the first token (sent with the first token, not awaited
    before the client has it)."""

    worker_id: str
    first_token: int


@dataclass(frozen=True)
class Submit:
    """D runs the request itself: from the prompt, or from `resume` after a migration. A refusal is
    answered with `on_submit_refused`."""

    worker_id: str
    resume: ResumeState | None = None


@dataclass(frozen=True)
class Abort:
    """Free what the worker holds of the request. `final`: the request is over (the worker refuses
    any late creation call for it); `wait`: the next command needs it done (a loss of D while
    waiting is answered with `on_worker_lost`); otherwise it runs beside the rest, errors ignored.
    A command that fails with the loss of D drops the rest of its batch: the handler of that loss
    says what comes next."""

    worker_id: str
    final: bool
    wait: bool = False


@dataclass(frozen=True)
class Emit:
    """Pass an output on to the client."""

    output: RequestOutput


@dataclass(frozen=True)
class Fail:
    """End the request with an error (the router answers 500, or 503 when retryable)."""

    message: str
    retryable: bool


@dataclass(frozen=True)
class WaitForDecode:
    """No decode worker to continue on: call `on_wait` again a moment later."""

    until: float


@dataclass(frozen=True)
class QueueTokens:
    """Change the prompt tokens counted as queued prefill work on a worker (the routing policy's
    queue term) by `delta`."""

    worker_id: str
    delta: int


@dataclass(frozen=True)
class Count:
    """Add `n` to one of the backend's counters."""

    name: str
    n: int = 1


@dataclass(frozen=True)
class MigrationGap:
    """Seconds from losing the decode worker to the next token on the new one."""

    seconds: float


Command = (
    Follow
    | Reserve
    | Prefill
    | StartDecode
    | Submit
    | Abort
    | Emit
    | Fail
    | WaitForDecode
    | QueueTokens
    | Count
    | MigrationGap
)

COUNTERS = (
    "remote_prefill",
    "local_prefill",
    "prefill_fallbacks",
    "prefill_retries",
    "kv_blocks_transferred",
    "kv_bytes_transferred",
    "migrations",
    "migrations_failed",
)


class WorkerPicker(Protocol):
    """What the flow asks of the pools when the routing policy is not asked again (a fallback
    prefill worker, a migration target)."""

    def usable(self, worker_id: str) -> bool:
        """Alive and taking new requests."""
        ...

    def pick(self, role: Role, exclude: frozenset[str]) -> str | None:
        """The least busy usable worker of the pool outside `exclude`, or None."""
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
    request_id: str
    prompt_len: int
    route: RouteDecision
    picker: WorkerPicker
    limits: FlowLimits = field(default_factory=FlowLimits)
    trace: RequestTrace | None = None
    state: FlowState = FlowState.ROUTED
    decode_worker: str | None = None
    prefill_worker: str | None = None  # the one prefilling now (None outside PREFILLING)
    tried_prefill: set[str] = field(default_factory=set)
    output_token_ids: list[int] = field(default_factory=list)  # what the client has
    text_chars: int = 0
    migrations: int = 0  # failed decode workers so far
    moves: int = 0  # every move, drains included; the attempt each Follow names
    error: str | None = None
    # Prompt tokens counted as queued prefill work on `queued_on` until the first token.
    queued_on: str | None = None
    queued: int = 0
    _started_at: float = 0.0
    _submitted_at: float = 0.0  # a local prefill's submit (its prefill time runs to the first output)
    _sent_at: float = 0.0  # a remote prefill's call
    _lost_at: float | None = None
    _lost_worker: str | None = None
    _wait_until: float = 0.0

    def __post_init__(self) -> None:
        if self.trace is None:
            self.trace = RequestTrace(self.request_id, self.prompt_len)

    # ---- the table -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state in TERMINAL

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

    # ---- handlers --------------------------------------------------------------------------------
    def start(self, now: float) -> list[Command]:
        """The route was chosen a moment ago; its workers may have died or started draining since."""
        self._expect("start", FlowState.ROUTED)
        self._started_at = now
        picker = self.picker
        decode = (
            self.route.decode_worker
            if picker.usable(self.route.decode_worker)
            else picker.pick(Role.DECODE, frozenset())
        )
        if decode is None:
            return self._fail("no live decode worker", retryable=True)
        self.decode_worker = decode
        self.trace.decode_worker = decode
        self.queued_on, self.queued = self.route.prefill_worker or decode, self.prompt_len
        commands: list[Command] = [Follow(decode), QueueTokens(self.queued_on, self.queued)]
        if self.route.prefill_worker is None:
            return commands + self._submit_locally(now)
        prefill = (
            self.route.prefill_worker
            if picker.usable(self.route.prefill_worker)
            else picker.pick(Role.PREFILL, frozenset())
        )
        if prefill is None:
            self.trace.fell_back_to_local = True
            self.trace.prefill_worker = None
            return commands + self._submit_locally(now)
        return commands + self._reserve(prefill)

    def on_reserved(self, reservation: KVReservation | None, now: float) -> list[Command]:
        """D's answer to Reserve: blocks set aside, or None (no room now: D queues it as a local request)."""
        self._expect("on_reserved", FlowState.RESERVING)
        if reservation is None:
            return self._fall_back_to_local(now)
        self._move(FlowState.PREFILLING)
        self._sent_at = now
        return [Prefill(self.prefill_worker, self.decode_worker, reservation)]

    def on_prefill_done(self, result: PrefillResult, now: float) -> list[Command]:
        """P prefilled, pushed the KV into D's blocks and sampled the first token."""
        self._expect("on_prefill_done", FlowState.PREFILLING)
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
            self._move(FlowState.FINISHED)
            return commands + [Emit(first), Abort(self.decode_worker, final=True)]
        self._move(FlowState.DECODING)
        return commands + [StartDecode(self.decode_worker, first.token_ids[0]), Emit(first)]

    def on_prefill_failed(self, worker_id: str, died: bool, now: float) -> list[Command]:
        """The prefill call failed: P died (another prefill worker tries, else D prefills), or P
        refused it (D prefills). D's reservation is freed first either way."""
        self._expect("on_prefill_failed", FlowState.PREFILLING)
        commands: list[Command] = [Count("prefill_fallbacks"), Abort(self.decode_worker, final=False, wait=True)]
        if died:
            retry = self.picker.pick(Role.PREFILL, frozenset(self.tried_prefill))
            if retry is not None:
                return commands + [Count("prefill_retries")] + self._reserve(retry)
        return commands + self._fall_back_to_local(now)

    def on_output(self, output: RequestOutput, now: float) -> list[Command]:
        """An increment from the current decode worker."""
        self._expect("on_output", FlowState.DECODING)
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
            self._move(FlowState.FINISHED)
        return commands

    def on_worker_lost(self, worker_id: str, failure: bool, now: float) -> list[Command]:
        """The request's decode worker died, stopped answering (`failure`), or is being drained."""
        if self.done or worker_id != self.decode_worker or self.state in (FlowState.ROUTED, FlowState.MIGRATING):
            return []  # a worker the request already left, or is leaving
        self._expect("on_worker_lost", FlowState.RESERVING, FlowState.PREFILLING, FlowState.DECODING)
        if failure:
            self.migrations += 1
            if self.migrations > self.limits.max_migrations:
                return [Count("migrations_failed")] + self._fail(
                    f"request {self.request_id} lost its decode worker {self.migrations} times (last {worker_id}); "
                    f"giving up after {self.limits.max_migrations} migrations",
                    retryable=True,
                )
        self._move(FlowState.MIGRATING)
        self._lost_at = self._lost_at if self._lost_at is not None else now
        self._lost_worker = worker_id
        self._wait_until = now + self.limits.migration_wait_s
        self.prefill_worker = None
        # Whatever the old worker still holds of the request must go (it may only have been slow).
        commands: list[Command] = [Abort(worker_id, final=False)]
        target = self.picker.pick(Role.DECODE, frozenset({worker_id}))
        if target is None:
            return commands + [WaitForDecode(self._wait_until)]
        return commands + self._continue_on(target)

    def on_drain(self, worker_id: str, now: float) -> list[Command]:
        """The decode worker is being removed: move off it without using a migration attempt."""
        return self.on_worker_lost(worker_id, failure=False, now=now)

    def on_wait(self, now: float) -> list[Command]:
        """A moment after WaitForDecode: is there a decode worker now (the lost one restarted included)?"""
        if self.done:
            return []
        self._expect("on_wait", FlowState.MIGRATING)
        target = self.picker.pick(Role.DECODE, frozenset())
        if target is None:
            if now > self._wait_until:
                return [Count("migrations_failed")] + self._fail(
                    f"request {self.request_id}: decode worker {self._lost_worker} was lost and no decode worker was "
                    f"live within {self.limits.migration_wait_s:.0f} s to continue it",
                    retryable=True,
                )
            return [WaitForDecode(self._wait_until)]
        commands: list[Command] = []
        if target == self._lost_worker:
            commands.append(Abort(target, final=False, wait=True))  # back after a restart: free it of the request first
        return commands + self._continue_on(target)

    def on_submit_refused(self, worker_id: str, message: str, now: float) -> list[Command]:
        """D refused to run the request (a bug, or a context it cannot hold): no retry helps."""
        if self.done or worker_id != self.decode_worker:
            return []
        self._expect("on_submit_refused", FlowState.DECODING)
        commands: list[Command] = [Count("migrations_failed")] if self.moves else []
        return commands + self._fail(
            f"request {self.request_id} could not run on {worker_id}: {message}", retryable=False
        )

    def on_client_gone(self, now: float) -> list[Command]:
        """The consumer went away (a client disconnect, or the stream closed on an error)."""
        if self.done:
            return []
        commands = self._free_everything()
        self._move(FlowState.ABORTED)
        return commands

    # ---- helpers ---------------------------------------------------------------------------------
    def _reserve(self, prefill: str) -> list[Command]:
        self._move(FlowState.RESERVING)
        self.prefill_worker = prefill
        self.tried_prefill.add(prefill)
        self.trace.prefill_worker = prefill
        return [Reserve(self.decode_worker)]

    def _submit_locally(self, now: float) -> list[Command]:
        self._move(FlowState.DECODING)
        self._submitted_at = now
        self.trace.queue_s = now - self._started_at
        return [Count("local_prefill"), Submit(self.decode_worker)]

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
        return [Count("migrations"), Follow(target, self.moves), Submit(target, self.resume_state())]

    def _record(self, output: RequestOutput) -> None:
        self.output_token_ids.extend(output.token_ids)
        self.text_chars += len(output.text)

    def _unqueue(self) -> list[Command]:
        if not self.queued:
            return []
        commands: list[Command] = [QueueTokens(self.queued_on, -self.queued)]
        self.queued = 0
        return commands

    def _free_everything(self) -> list[Command]:
        commands = self._unqueue()
        if self.decode_worker is not None:
            commands.append(Abort(self.decode_worker, final=True))
        if self.prefill_worker is not None:
            commands.append(Abort(self.prefill_worker, final=True))
        return commands

    def _fail(self, message: str, retryable: bool) -> list[Command]:
        commands = self._free_everything()
        self.error = message
        self._move(FlowState.FAILED)
        return commands + [Fail(message, retryable)]
