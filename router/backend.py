"""The boundary between the HTTP layer and the worker pools.

The router talks to workers only through `ServingBackend`: `router.ray_backend.RayBackend` implements
it over Ray actor pools, and `testkit.backend.FakeBackend` in process, so the HTTP layer is testable
without Ray.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from common.lora import LoRAModuleSpec, LoRAStatus
from common.protocol import GrammarCounts, RequestOutput, SpecDecodeStats
from common.request import RequestContext, WorkerRequest
from common.roles import Role
from common.sampling_params import SamplingParams
from router.flow_commands import EndReason
from router.prefix_index import PrefixIndex
from router.trace import RequestTrace

__all__ = [
    "BackendError",
    "GenerateRequest",
    "RouteDecision",
    "ServingBackend",
    "WorkerInfo",
]


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the router sees it: its pool, whether it is alive, and its load."""

    worker_id: str
    role: Role
    alive: bool = True
    running: int = 0  # sequences being computed
    waiting: int = 0  # sequences queued
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0 to 1
    # Prompt tokens routed to this worker whose prefill has not produced a first token yet (the
    # router's own count: the KV-aware policy's queue term).
    queued_prefill_tokens: int = 0
    prefix_cache_queries: int = 0  # cumulative, from the worker's prefix cache
    prefix_cache_hits: int = 0
    last_heartbeat: float | None = None  # wall-clock time of the last stats answer (None: never)
    # Being removed (scaling down): finishes or migrates what it runs, gets no new request.
    draining: bool = False
    pid: int | None = None  # the worker's process (for memory checks on one machine); None: unknown
    in_flight: int = 0  # requests the router has on it now (decoding there, or prefilling there)
    kv_transfer_failures: Mapping[str, int] = field(default_factory=dict)  # received KV that failed, by reason
    grammar: GrammarCounts = field(default_factory=GrammarCounts)  # structured output's compile cache on the worker
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # speculative decoding on the worker
    tp_size: int = 1  # its tensor-parallel group's ranks
    rank_pids: tuple[int, ...] = ()  # the processes of its ranks 1..tp_size-1 (pid is rank 0's)
    lora: LoRAStatus = field(default_factory=LoRAStatus)  # its LoRA adapters, as its last stats said


@dataclass(frozen=True)
class RouteDecision:
    """Where a request runs: decode worker D, and prefill worker P (None: D prefills locally)."""

    decode_worker: str
    prefill_worker: str | None = None
    reason: str = ""  # for metrics and logs, e.g. "round_robin"
    # Leading prompt blocks the prefilling worker (P, or D when local) holds per the prefix index.
    cached_blocks: int = 0


@dataclass(frozen=True)
class GenerateRequest:
    """One request for the pools: what every worker sees of it (`request`: its context, prompt and
    sampling), where it was routed, and its trace, which the backend fills in (router.trace)."""

    request: WorkerRequest
    route: RouteDecision
    trace: RequestTrace

    @property
    def context(self) -> RequestContext:
        return self.request.context

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params


class BackendError(RuntimeError):
    """A failure inside the worker pools (the router answers 500, or 503 when retryable). `reason`,
    when the request's flow ended it, says why (router.flow_commands.EndReason) and decides
    whether it is retryable."""

    def __init__(self, message: str, retryable: bool = False, reason: EndReason | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = reason.retryable if reason is not None else retryable


@runtime_checkable
class LoRABackend(Protocol):
    """A backend whose workers load and unload LoRA adapters while serving (the Ray backend)."""

    async def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        """Every worker serves the adapter from now on; ValueError (naming why) when one cannot."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """No worker serves the adapter from now on."""
        ...


@runtime_checkable
class ServingBackend(Protocol):
    # Read-only members, so a backend may hold them as attributes or give them as properties.
    @property
    def prefix_index(self) -> PrefixIndex | None:
        """What the router knows of each worker's prefix cache (None: the backend keeps no index)."""
        ...

    @property
    def counters(self) -> Mapping[str, int]:
        """Healing and routing events so far (router.flow.COUNTERS), exported as metrics."""
        ...

    def workers(self) -> list[WorkerInfo]:
        """A snapshot of every worker of both pools (cheap: called per request by the routing policy)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """An async generator of increments (new token ids and text) ending with one finished output."""
        ...

    async def abort(self, request_id: str, reason: EndReason = EndReason.CLIENT_GONE) -> None:
        """Stop a request and free its resources: the client went away, or (`EndReason.DEADLINE`)
        it ran past its deadline. A no-op for unknown or finished requests."""
        ...
