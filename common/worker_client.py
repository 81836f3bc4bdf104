"""The typed client of a worker's Ray actor: the only code that calls a worker method with `.remote(`.

Each method mirrors `common.worker_api.WorkerAPI` with the same record and returns what Ray's
call returns (an ObjectRef: `await` it on an event loop, `ray.get` it elsewhere). Creating the
actors stays with the placement code (cluster.placement), which wraps each handle in one of these.
Test fakes pass any object whose methods have a `.remote(...)` returning an awaitable.

Imports Ray's types only for annotations: the router, which imports this module, stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

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
from common.request import AbortRequest, PrefillRequest, ReserveRequest, StartDecodeRequest, SubmitRequest
from common.sampling_params import SamplingParams
from common.transports import PeerLink

if TYPE_CHECKING:  # annotations only
    from ray import ObjectRef

__all__ = ["WorkerClient"]


class WorkerClient:
    """A worker's actor handle with `common.worker_api.WorkerAPI`'s methods, each returning the
    call's ObjectRef."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"WorkerClient({self.handle!r})"

    # ---- start-up and the KV transport ----------------------------------------------------------
    def ready(self) -> ObjectRef[WorkerReady]:
        return cast("ObjectRef[WorkerReady]", self.handle.ready.remote())

    def endpoint(self) -> ObjectRef[KVEndpoint]:
        return cast("ObjectRef[KVEndpoint]", self.handle.endpoint.remote())

    def connect_peer(self, endpoint: KVEndpoint) -> ObjectRef[str]:
        return cast("ObjectRef[str]", self.handle.connect_peer.remote(endpoint))

    def kv_links(self) -> ObjectRef[list[PeerLink]]:
        return cast("ObjectRef[list[PeerLink]]", self.handle.kv_links.remote())

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, request: SubmitRequest) -> ObjectRef[None]:
        return cast("ObjectRef[None]", self.handle.submit.remote(request))

    def reserve(self, request: ReserveRequest) -> ObjectRef[KVReservation | None]:
        return cast("ObjectRef[KVReservation | None]", self.handle.reserve.remote(request))

    def prefill(self, request: PrefillRequest) -> ObjectRef[None]:
        return cast("ObjectRef[None]", self.handle.prefill.remote(request))

    def start_decode(self, request: StartDecodeRequest) -> ObjectRef[None]:
        return cast("ObjectRef[None]", self.handle.start_decode.remote(request))

    def abort(self, request: AbortRequest) -> ObjectRef[bool]:
        return cast("ObjectRef[bool]", self.handle.abort.remote(request))

    def compile_grammar(self, params: SamplingParams) -> ObjectRef[None]:
        return cast("ObjectRef[None]", self.handle.compile_grammar.remote(params))

    def load_lora_adapter(self, spec: LoRAModuleSpec) -> ObjectRef[None]:
        return cast("ObjectRef[None]", self.handle.load_lora_adapter.remote(spec))

    def unload_lora_adapter(self, name: str) -> ObjectRef[bool]:
        return cast("ObjectRef[bool]", self.handle.unload_lora_adapter.remote(name))

    # ---- outputs, leases and health ---------------------------------------------------------------
    def poll_outputs(self, timeout_s: float = 0.05, router: RouterClaim | None = None) -> ObjectRef[list[WorkerOutput]]:
        return cast("ObjectRef[list[WorkerOutput]]", self.handle.poll_outputs.remote(timeout_s, router))

    def renew_lease(self, router: RouterClaim) -> ObjectRef[None]:
        return cast("ObjectRef[None]", self.handle.renew_lease.remote(router))

    def heartbeat(self, router: RouterClaim | None = None) -> ObjectRef[WorkerHeartbeat]:
        return cast("ObjectRef[WorkerHeartbeat]", self.handle.heartbeat.remote(router))

    def stats(self) -> ObjectRef[WorkerStats]:
        return cast("ObjectRef[WorkerStats]", self.handle.stats.remote())

    def shutdown(self) -> ObjectRef[None]:
        return cast("ObjectRef[None]", self.handle.shutdown.remote())
