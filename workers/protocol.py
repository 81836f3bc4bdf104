"""Everything that crosses a process boundary between the router and the workers: plain,
torch-free dataclasses (requests, outputs, KV events, worker stats and heartbeats).

The router imports this module; so it must never import torch or an engine module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    """Log-probability of a generated token, and of the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One step's increment for one request.

    token_ids and text hold only what is new since the previous output of that request; text
    already has stop strings cut off. finish_reason is "stop" (EOS, stop token or stop string),
    "length" (max_tokens or the context limit) or "abort".
    """

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    created_at: float = 0.0  # time.time() when the worker queued it (streaming-overhead measurement)


@dataclass(frozen=True)
class KVReservation:
    """Blocks a decode worker set aside for a prompt whose KV another worker computes.

    The first num_cached_tokens tokens (whole blocks) were already in this worker's prefix cache;
    the sender only needs to fill block_ids[num_cached_tokens // block_size:].
    """

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int



class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"  # the worker dropped its whole cache (restart, reset)


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The decode worker's KVEndpoint, pickled: the router passes it through without unpickling
    # (unpickling would import torch there). None: nothing to send.
    peer_endpoint: bytes | None
    dst_block_ids: list[int] = field(default_factory=list)
    dst_num_cached_tokens: int = 0  # leading tokens (whole blocks) the decode worker had cached


@dataclass(frozen=True)
class PrefillResult:
    output: RequestOutput  # the first token (finished when the request ends with it)
    num_blocks_sent: int
    bytes_sent: int
    transfer_seconds: float
    prefill_seconds: float


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_blocks_sent: int
    kv_bytes_sent: int
    kv_blocks_received: int
    prompt_tokens: int
    generation_tokens: int
    pid: int


@dataclass(frozen=True)
class KVEventBatch:
    """KV events since the last heartbeat, in order. When the bounded buffer overflowed (nobody
    collected for a long time), `events` is empty and `snapshot` holds every hash cached now."""

    events: list[KVEvent]
    snapshot: tuple[int, ...] | None = None
    block_size: int = 16


@dataclass(frozen=True)
class WorkerHeartbeat:
    """What the router's health loop collects in one RPC per interval: load and KV events."""

    stats: WorkerStats
    kv_events: KVEventBatch
