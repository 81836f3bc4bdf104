"""What a request's flow tells its executor to do, and how a request ends.

`router.flow.RequestFlow`'s handlers return these commands, in order; an executor carries them out
(`router.ray_backend.RayBackend` as calls to Ray actors, `cluster.sim.simulator.Simulator` as
events on simulated workers) and answers with the flow's next handler. No command does anything
by itself: they are plain records, compared by value in tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.protocol import KVReservation, RequestOutput, ResumeState

__all__ = [
    "COUNTERS",
    "Abort",
    "Command",
    "Count",
    "Emit",
    "EndReason",
    "Fail",
    "MigrationGap",
    "Prefill",
    "QueueTokens",
    "Reserve",
    "StartDecode",
    "Submit",
    "WaitForDecode",
]


class EndReason(enum.Enum):
    """Why a request ended: FINISHED's one reason, ABORTED's one, and FAILED's several."""

    FINISHED = "finished"  # its last token reached the client
    CLIENT_GONE = "client_gone"  # the consumer went away (ABORTED)
    NO_WORKER = "no_worker"  # no live decode worker to start on
    WORKER_LOST = "worker_lost"  # its decode workers kept dying, or none was live within the wait
    KV_LOAD_FAILED = "kv_load_failed"  # the KV pushed to the decode worker failed (policy `fail`)
    BAD_INPUT = "bad_input"  # a worker refused the request as bad input (its grammar does not compile)
    REFUSED = "refused"  # a decode worker refused to run it (a bug, or a context it cannot hold)
    ERROR = "error"  # a call failed unexpectedly
    DEADLINE = "deadline"  # it ran past its deadline

    @property
    def retryable(self) -> bool:
        """The same request may succeed if sent again (the router answers 503 with Retry-After)."""
        return self in (EndReason.NO_WORKER, EndReason.WORKER_LOST, EndReason.KV_LOAD_FAILED)


@dataclass(frozen=True)
class Reserve:
    """Ask decode worker D to set blocks aside for the prompt; answer with `on_reserved`. Its
    outputs, later, are stamped with `attempt`."""

    worker_id: str
    attempt: int = 0


@dataclass(frozen=True)
class Prefill:
    """Prefill on P into D's reserved blocks; the outcome comes from P's outbox
    (`on_worker_output`), or the call's failure answers with `on_prefill_failed`."""

    worker_id: str
    decode_worker: str
    reservation: KVReservation


@dataclass(frozen=True)
class StartDecode:
    """The KV is on D: let it decode on from the first token (sent with the first token, not awaited
    before the client has it; a failure arrives as an event)."""

    worker_id: str
    first_token: int
    kv_namespace: str | None = None  # what the prefill worker computed the KV under (PrefillResult's)


@dataclass(frozen=True)
class Submit:
    """D runs the request itself: from the prompt, or from `resume` after a migration; its outputs
    are stamped with `attempt`. A refusal is answered with `on_submit_refused`."""

    worker_id: str
    attempt: int = 0
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
    """End the request with an error: 503 when its reason is retryable, 400 for bad input, 504 past
    its deadline, else 500."""

    message: str
    reason: EndReason

    @property
    def retryable(self) -> bool:
        return self.reason.retryable


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
    """Add `n` to one of the backend's counters (COUNTERS)."""

    name: str
    n: int = 1


@dataclass(frozen=True)
class MigrationGap:
    """Seconds from losing the decode worker to the next token on the new one."""

    seconds: float


Command = (
    Reserve | Prefill | StartDecode | Submit | Abort | Emit | Fail | WaitForDecode | QueueTokens | Count | MigrationGap
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
