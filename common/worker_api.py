"""The one interface of a worker, as the router, the pool manager and the simulator call it.

Three things implement `WorkerAPI`: the engine worker (`workers.shell.worker.EngineWorker`), its
Ray actor shell (`workers.shell.actors.WorkerActor`, which forwards every call unchanged), and the
simulated worker (`cluster.sim.engine.SimWorker`). Callers reach a Ray actor through the typed
client (`common.worker_client.WorkerClient`), whose methods mirror these and return awaitables;
nothing else calls a worker method with `.remote(`. tests/unit/test_worker_api.py holds each
implementation to this protocol.

Every call that creates or changes a request's state takes a record of `common.request` and
answers at once; what takes engine time (a prompt's first token and its KV handoff, decoded
tokens) reaches the request's router through the worker's outbox, which `poll_outputs` drains
(`WorkerOutput`): the same for a Ray actor, an in-process worker and a simulated one.

Torch-free: the router imports this module.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from common.lora import LoRAModuleSpec
from common.protocol import (
    KVEndpoint,
    KVReservation,
    RouterClaim,
    WorkerHeartbeat,
    WorkerOutput,
    WorkerReady,
    WorkerStats,
)
from common.request import (
    AbortRequest,
    PrefillRequest,
    ReserveRequest,
    StartDecodeRequest,
    SubmitRequest,
)
from common.sampling_params import SamplingParams
from common.transports import PeerLink

__all__ = ["WORKER_METHODS", "WorkerAPI"]


@runtime_checkable
class WorkerAPI(Protocol):
    """A prefill or decode worker. Calls are answered without waiting on engine steps beyond the
    one running (a call is queued for the engine thread, between two steps), except
    `poll_outputs`, which waits up to its timeout for the first output."""

    # ---- start-up and the KV transport ----------------------------------------------------------
    def ready(self) -> WorkerReady:
        """The limits the built engine really has (the router refuses what no worker can hold)."""
        ...

    def endpoint(self) -> KVEndpoint:
        """This worker's KV cache as prefill workers push into it."""
        ...

    def connect_peer(self, endpoint: KVEndpoint) -> str:
        """Handshake with a decode worker's cache now; returns the backend serving the pair
        (raises KVLayoutMismatch naming the field when the layouts cannot pair)."""
        ...

    def kv_links(self) -> list[PeerLink]:
        """The decode workers this worker has connected to, and what went over each link."""
        ...

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, request: SubmitRequest) -> None:
        """Run the whole request here (a local prefill, or a migrated request's resume)."""
        ...

    def reserve(self, request: ReserveRequest) -> KVReservation | None:
        """Set aside blocks for the prompt a prefill worker computes; None when full right now."""
        ...

    def prefill(self, request: PrefillRequest) -> None:
        """Queue the prompt; its first token and KV handoff end as a PrefillResult (or
        PrefillFailed) in the owner's outbox."""
        ...

    def start_decode(self, request: StartDecodeRequest) -> None:
        """The KV has been pushed: verify it and decode on from the first token."""
        ...

    def abort(self, request: AbortRequest) -> bool:
        """Free what this worker holds of the request; True when it held something."""
        ...

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a structured output's grammar now (cached); GrammarCompileError when it cannot."""
        ...

    def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        """Serve the LoRA adapter `spec` names from now on; ValueError says why it cannot."""
        ...

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving adapter `name`; False when it was not served here."""
        ...

    # ---- outputs, leases and health ---------------------------------------------------------------
    def poll_outputs(self, timeout_s: float = 0.05, router: RouterClaim | None = None) -> list[WorkerOutput]:
        """Every output queued for `router`, waiting up to timeout_s for the first (renews its lease)."""
        ...

    def renew_lease(self, router: RouterClaim) -> None:
        """Keep the router's requests alive here for another lease term."""
        ...

    def heartbeat(self, router: RouterClaim | None = None) -> WorkerHeartbeat:
        """Load, and the router's KV events since its last heartbeat."""
        ...

    def stats(self) -> WorkerStats: ...

    def shutdown(self) -> None: ...


# The protocol's methods, in the order above: what the typed client mirrors and what no code
# outside it may call with `.remote(` (tests/unit/test_boundaries.py).
WORKER_METHODS: tuple[str, ...] = tuple(
    name for name in WorkerAPI.__dict__ if not name.startswith("_") and callable(WorkerAPI.__dict__[name])
)
