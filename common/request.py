"""A request's identity, created once at the HTTP edge, and the records every worker call carries.

`RequestContext` is who a request is and how it must be treated: the model and adapter it runs
under, its priority, its tenant, its deadline, the trace it belongs to. The router makes it when
the request arrives (router.serving), and it travels unchanged inside the records below to every
worker call, into the engine's `Sequence` and into the simulator. A new per-request field is one
field here, read where it is used.

The call records (`SubmitRequest`, `ReserveRequest`, `PrefillRequest`, `StartDecodeRequest`,
`AbortRequest`) are what `common.worker_api.WorkerAPI` takes: named fields instead of positional
arguments, so adding one is a change to a dataclass, not to every call site.

Torch-free: the router imports this module.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from common.protocol import KVEndpoint, ResumeState, RouterClaim
from common.sampling_params import SamplingParams

__all__ = [
    "DEFAULT_TENANT",
    "AbortRequest",
    "PrefillRequest",
    "RequestContext",
    "RequestOwner",
    "ReserveRequest",
    "StartDecodeRequest",
    "SubmitRequest",
    "WorkerRequest",
]

DEFAULT_TENANT = "default"  # the tenant of a request that names none


@dataclass(frozen=True)
class RequestContext:
    """Who a request is, created once where it enters and never changed on its way.

    `request_id` names it in the pools (one per choice of an n > 1 request); `trace_id` names the
    HTTP request it belongs to (shared by its choices, sent back as X-Request-Id). `deadline` is a
    wall-clock time (`time.time()`, which every host of a cluster shares closely enough; the
    monotonic clock is per host); None: none. `adapter` is a LoRA adapter's name (None: the base
    model). `priority`: lower runs first (vLLM's); `ttft_target`: a wall-clock time its first token
    is wanted by (llm-d's x-llm-d-slo-ttft-ms), which orders requests of one priority."""

    request_id: str
    model: str = ""
    adapter: str | None = None
    priority: int = 0
    tenant: str = DEFAULT_TENANT
    deadline: float | None = None
    ttft_target: float | None = None
    trace_id: str = ""
    arrival_time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"RequestContext.request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"RequestContext.priority must be an integer, got {self.priority!r}")
        if not self.tenant:
            raise ValueError("RequestContext.tenant must not be empty")
        if self.adapter is not None and not self.adapter:
            raise ValueError("RequestContext.adapter must be a name or None, not an empty string")
        for name in ("deadline", "ttft_target"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"RequestContext.{name} must be a finite time or None, got {value!r}")
        if not self.trace_id:
            object.__setattr__(self, "trace_id", self.request_id)

    def for_choice(self, request_id: str) -> RequestContext:
        """The same request under another pools id (choice i of an n > 1 request)."""
        return replace(self, request_id=request_id)

    @property
    def kv_namespace(self) -> str | None:
        """What a KV block of this request depends on besides its tokens (None: nothing): the
        adapter's name, since one adapter's KV of a prompt is not another's. It seeds the chained
        block hashes (common.block_hash.root_hash) in the router's prefix index and in the
        worker's prefix cache alike, so no cache ever hands one adapter's blocks to another."""
        return self.adapter

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (negative: past it), or None without one."""
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)


@dataclass(frozen=True)
class RequestOwner:
    """Whose a request's outputs are on a worker: the router that made the call (its outbox and
    its lease; None: the default router of calls without a claim) and that router's attempt at
    the request (router.flow.Follow), stamped on the outputs so an earlier attempt's are told
    apart."""

    router: RouterClaim | None = None
    attempt: int = 0


@dataclass(frozen=True)
class WorkerRequest:
    """The request as every worker sees it: identity, prompt and sampling."""

    context: RequestContext
    prompt_token_ids: list[int]
    sampling_params: SamplingParams

    @property
    def request_id(self) -> str:
        return self.context.request_id


@dataclass(frozen=True)
class SubmitRequest:
    """Run the whole request on this (decode) worker: from its prompt, or from `resume` after a
    migration (prompt + the tokens the client already has are prefilled, decoding goes on)."""

    request: WorkerRequest
    owner: RequestOwner = RequestOwner()
    resume: ResumeState | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class ReserveRequest:
    """Set blocks aside on this decode worker for a prompt another worker prefills."""

    request: WorkerRequest
    owner: RequestOwner = RequestOwner()

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class PrefillRequest:
    """Compute the prompt to its first token on this prefill worker and push its KV into the
    decode worker's reserved blocks (`peer_endpoint`; None: nothing to send). The outcome reaches
    the owner's outbox as a `common.protocol.PrefillResult` or `PrefillFailed`."""

    request: WorkerRequest
    peer_endpoint: KVEndpoint | None
    dst_block_ids: list[int] = field(default_factory=list)
    dst_num_cached_tokens: int = 0  # leading tokens (whole blocks) the decode worker had cached
    owner: RequestOwner = RequestOwner()

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class StartDecodeRequest:
    """The prefill worker pushed the prompt's KV: check it landed and decode on from `first_token`."""

    request_id: str
    first_token: int
    # The namespace the prefill worker computed the KV under (its LoRA adapter); the decode worker
    # refuses KV computed under another than its own request's.
    kv_namespace: str | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Free what the worker holds of the request. `final`: the router has ended it for good (a
    creation call for it that arrives later is refused); otherwise it is being started again
    elsewhere or here (a prefill fallback, a migration back to a restarted worker)."""

    request_id: str
    final: bool = True
