"""Everything that crosses a process boundary between the router and the workers: plain,
torch-free dataclasses (requests, outputs, KV events, the KV layout and transfer
endpoints, worker stats and heartbeats).

The router imports this module; so it must never import torch or an engine module.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from common.lora import LoRAStatus
from common.roles import Role


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
    # Speculative decoding: draft tokens proposed for the request on this worker so far, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # The router's attempt at the request whose run made it (router.flow.Follow), as the creation
    # call named it: a router that comes back to a worker drops what an earlier attempt left queued.
    attempt: int = 0


@dataclass(frozen=True)
class KVReservation:
    """Blocks a decode worker set aside for a prompt whose KV another worker computes.

    The first num_cached_tokens tokens (whole blocks) were already in this worker's prefix cache;
    the sender only needs to fill block_ids[num_cached_tokens // block_size:].
    """

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int


@dataclass(frozen=True)
class ResumeState:
    """Where a migrated request stands: its first decode worker died after producing
    `output_token_ids`, of whose text the client already received `text_chars` characters. The
    new decode worker prefills prompt + these tokens and decodes on from there (stop conditions,
    penalties and usage count them; their text is not sent again)."""

    output_token_ids: tuple[int, ...]
    text_chars: int


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"  # the worker dropped its whole cache (restart, reset)


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hashes: tuple[int, ...] = ()


# ---- KV transfer: the layout both ends must agree on, and a receiver's endpoint -------------

# Bytes per element of each KV cache dtype, by torch's dtype name (without "torch.").
KV_DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
}


class KVLayoutMismatch(ValueError):
    """Two workers' KV caches cannot exchange blocks; the message names the field."""


@dataclass(frozen=True)
class KVLayout:
    """Everything both ends must agree on for raw block bytes to mean the same thing.

    The cache is `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` of `dtype`
    (a name from KV_DTYPE_ITEMSIZE). `kv_scales` holds one (k_scale, v_scale) pair per layer
    for FP8 caches; it is empty for other dtypes (scales of 1.0 are normalised to empty, so
    "no scales" and "all ones" agree). `layer_windows` holds each layer's sliding window (None:
    global) when the model has windows, else it is empty (all-None is normalised to empty): a
    sender that released out-of-window blocks and a receiver that expects them must not pair.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_scales: tuple[tuple[float, float], ...] = ()
    layer_windows: tuple[int | None, ...] = ()
    # Tensor parallelism: the size of the worker's group, and the model's KV heads [start, stop)
    # this rank's cache holds (None: heads 0..num_kv_heads-1, all of them at size 1). Groups of
    # different sizes pair (kvtransfer.resharding): what must agree is the heads of each link.
    tp_size: int = 1
    kv_heads: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in KV_DTYPE_ITEMSIZE:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(KV_DTYPE_ITEMSIZE)}")
        scales = tuple((float(k), float(v)) for k, v in self.kv_scales)
        if scales and len(scales) != self.num_layers:
            raise ValueError(
                f"KVLayout.kv_scales has {len(scales)} entries, expected one (k, v) pair per layer ({self.num_layers})"
            )
        for i, (k, v) in enumerate(scales):
            if not (math.isfinite(k) and math.isfinite(v) and k > 0 and v > 0):
                raise ValueError(f"KVLayout.kv_scales[{i}] = {(k, v)} must be finite and > 0")
        if all(k == 1.0 and v == 1.0 for k, v in scales):
            scales = ()
        object.__setattr__(self, "kv_scales", scales)
        windows = tuple(None if w is None else int(w) for w in self.layer_windows)
        if windows and len(windows) != self.num_layers:
            raise ValueError(
                f"KVLayout.layer_windows has {len(windows)} entries, expected one per layer ({self.num_layers})"
            )
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"KVLayout.layer_windows {windows} must hold None or windows >= 1")
        object.__setattr__(self, "layer_windows", windows if any(w is not None for w in windows) else ())
        if self.kv_heads is not None:
            start, stop = (int(h) for h in self.kv_heads)
            if not 0 <= start < stop or stop - start != self.num_kv_heads:
                raise ValueError(
                    f"KVLayout.kv_heads {self.kv_heads} must be a range of num_kv_heads ({self.num_kv_heads}) heads"
                )
            # Heads 0..n-1 of n are what a layout that names no heads holds: one meaning, one value.
            object.__setattr__(self, "kv_heads", None if start == 0 else (start, stop))

    @property
    def element_size(self) -> int:
        return KV_DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def check_compatible(self, peer: KVLayout) -> None:
        """Raise KVLayoutMismatch naming the first field that differs (ours vs the peer's)."""
        if not isinstance(peer, KVLayout):
            raise KVLayoutMismatch(f"peer layout is {type(peer).__name__}, not KVLayout")
        checks = (
            ("kv_heads", self.kv_heads, peer.kv_heads),
            ("dtype", self.dtype, peer.dtype),
            ("block_size", self.block_size, peer.block_size),
            ("num_layers", self.num_layers, peer.num_layers),
            ("num_kv_heads", self.num_kv_heads, peer.num_kv_heads),
            ("head_dim", self.head_dim, peer.head_dim),
            ("layer_windows", self.layer_windows, getattr(peer, "layer_windows", ())),
        )
        for name, ours, theirs in checks:
            if ours != theirs:
                raise KVLayoutMismatch(f"KV layout mismatch: {name} local={ours!r} peer={theirs!r}")
        if self.kv_scales != peer.kv_scales:
            # Raw FP8 bytes quantised with one scale and dequantised with another are wrong
            # values, silently; name the first differing layer to make that debuggable.
            ours_s = self.kv_scales or ((1.0, 1.0),) * self.num_layers
            theirs_s = peer.kv_scales or ((1.0, 1.0),) * peer.num_layers
            layer = next(i for i, (a, b) in enumerate(zip(ours_s, theirs_s)) if a != b)
            raise KVLayoutMismatch(
                f"KV layout mismatch: kv_scales differ at layer {layer}: "
                f"local={ours_s[layer]!r} peer={theirs_s[layer]!r}"
            )


@dataclass(frozen=True)
class KVEndpoint:
    """A receiver's cache as its peers see it: a decode worker publishes it, the router passes
    it on in PrefillRequest, a prefill worker's transport connects to it.

    `kind` names the transport backend; `address` is backend-specific plain data (segment
    name, control server host/port/key) and takes no part in equality or hashing.
    """

    kind: str
    worker_id: str
    layout: KVLayout
    num_blocks: int
    address: dict[str, object] = field(default_factory=dict, compare=False)
    # A tensor-parallel worker: the endpoints of its ranks 1..N-1 (this one is rank 0's); each
    # prefill rank pushes its heads into the ranks that hold them (kvtransfer.resharding).
    ranks: tuple[KVEndpoint, ...] = field(default=(), compare=False)
    # A rank fed by a prefill group of finer ranks: the caches that receive a part of its heads
    # (one per prefill rank's heads; kvtransfer.resharding).
    inlets: tuple[KVEndpoint, ...] = field(default=(), compare=False)
    # A worker with a draft model (speculative decoding's draft_model): the draft's own cache, into
    # which a prefill worker pushes the draft's KV of the prompt beside the target's (kvtransfer.resharding).
    draft: KVEndpoint | None = field(default=None, compare=False)

    @property
    def peer_key(self) -> tuple[str, str]:
        """Identifies the receiving transport (worker ids are unique per transport)."""
        return (self.kind, self.worker_id)


# ---- several routers: who owns a request on a worker, and the lease that keeps it ------------

DEFAULT_ROUTER_ID = "router-0"  # the single router's, and that of calls made without a claim


@dataclass(frozen=True)
class RouterClaim:
    """A router's identity on a worker, sent with its calls: the requests it creates are its own
    (their outputs go to its outbox), and each call renews its lease for `lease_s` seconds; when
    the lease runs out the worker ends the router's requests and frees their blocks."""

    router_id: str
    lease_s: float

    def __post_init__(self) -> None:
        if not self.router_id:
            raise ValueError("RouterClaim.router_id must not be empty")
        if not self.lease_s > 0:
            raise ValueError(f"RouterClaim.lease_s must be > 0 seconds, got {self.lease_s}")


@dataclass(frozen=True)
class RouterLeaseInfo:
    """A router holding a lease on a worker, as the worker's heartbeat reports it."""

    router_id: str
    requests: int  # the requests of that router on the worker now
    idle_s: float  # since its last renewal
    lease_s: float  # its term (inf: the default router of calls without a claim)


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's outcome of a `common.request.PrefillRequest`: the first token, and the
    KV handoff into the decode worker's reserved blocks (done when this is sent)."""

    output: RequestOutput  # the first token (finished when the request ends with it)
    num_blocks_sent: int
    bytes_sent: int
    transfer_seconds: float
    prefill_seconds: float
    # Tensor-parallel workers: (prefill rank, decode rank, bytes) of each rank pair that moved KV heads
    # (kvtransfer.resharding); bytes_sent is their sum.
    rank_pairs: tuple[tuple[int, int, int], ...] = ()
    # What the KV was computed under besides the tokens (RequestContext.kv_namespace: the LoRA
    # adapter): the decode worker refuses KV of another namespace than its request's.
    kv_namespace: str | None = None

    @property
    def request_id(self) -> str:
        return self.output.request_id


@dataclass(frozen=True)
class PrefillFailed:
    """A prefill worker could not finish a `common.request.PrefillRequest` (its KV transfer failed
    or timed out, the engine failed, or it was refused): the router prefills elsewhere."""

    request_id: str
    message: str
    created_at: float = 0.0  # time.time() when the worker queued it


# What a worker's outbox carries (`common.worker_api.WorkerAPI.poll_outputs`): decoded tokens, and
# the outcomes of prefills. Each ends the worker's part in the request except an unfinished output.
WorkerOutput = RequestOutput | PrefillResult | PrefillFailed


class GrammarCompileError(ValueError):
    """A request's structured output does not compile on the worker (a feature the grammar backend
    does not support, or a compile over its time limit): bad input, not a worker failure. The
    worker raises it before it holds anything of the request; the router answers 400."""


# Upper bounds (seconds) of the grammar compile-time histogram the workers keep
# (baton:structured_output_compile_seconds).
COMPILE_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True)
class GrammarCounts:
    """A worker's grammar cache since start: lookups found compiled (hits) or not (misses), and the
    compile times as a histogram: `compile_buckets[i]` compiles took at most COMPILE_SECONDS_BUCKETS[i]
    seconds (cumulative, as Prometheus counts them), `compiles` in all (the +Inf bucket)."""

    cache_hits: int = 0
    cache_misses: int = 0
    compiles: int = 0
    compile_seconds_sum: float = 0.0
    compile_buckets: tuple[int, ...] = ()


@dataclass(frozen=True)
class SpecDecodeStats:
    """A worker's speculative decoding since start (vLLM's spec_decode counters): verifications
    (sequences with drafts in a step), draft tokens proposed, drafts accepted, and
    `accepted_per_pos[j]` drafts accepted at draft position j."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: Role
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
    # Received KV transfers that failed, by reason (kvtransfer.integrity.FailureReason values).
    kv_transfer_failures: dict[str, int] = field(default_factory=dict)
    grammar: GrammarCounts = field(default_factory=GrammarCounts)  # structured output's compile cache
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # zeros without speculative decoding
    tp_size: int = 1  # the worker's tensor-parallel group: its ranks, rank 0 (this process) included
    rank_pids: tuple[int, ...] = ()  # the processes of ranks 1..tp_size-1
    lora: LoRAStatus = field(default_factory=LoRAStatus)  # its LoRA adapters (max_loras 0: none served)


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
    routers: tuple[RouterLeaseInfo, ...] = ()  # the routers holding a lease on the worker


@dataclass(frozen=True)
class WorkerReady:
    """A worker's start-up report (`ready()`): the limits its engine really has, so the router
    refuses what no worker can hold instead of failing inside one."""

    worker_id: str
    role: Role
    max_model_len: int  # the engine's: the model's context, capped by what the KV cache holds
    block_size: int
    num_blocks: int
    dtype: str  # weights and activations
    kv_cache_dtype: str  # the cache's element type as stored, e.g. "float32" or "float8_e4m3fn"
