"""Typed boundary of `kvtransfer`: the KV layout handshake, transfer status/handles, and the
`KVTransport` interface every backend implements.

Roles. A *receiver* (decode worker D) reserves destination block ids in its paged cache and
calls `expect()`; a *sender* (prefill worker P) calls `send()` to push its source blocks into
those ids. Both sides get a `TransferHandle` they can `poll()`, `wait()` on or `abort()`.
`expect()` is required on every backend, including one-sided ones (shared memory, in-process):
it is what lets the receiver learn completion and lets an abort on D guarantee that no write
lands in blocks D has already freed.

The cache layout is the engine's: `kv_cache[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`. Backends move raw bytes, so every dtype (FP8 included) arrives
bit-exact; the handshake makes sure both sides interpret those bytes the same way. `KVLayout`
and `KVEndpoint` themselves are torch-free (common.protocol); the torch side of the layout
(dtype mapping, reading and checking a cache tensor) is here.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.protocol import KVEndpoint, KVLayout
from common.transports import Place

# The torch dtype behind each KVLayout.dtype name (the layout itself is torch-free).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class KVTransferError(RuntimeError):
    """A transport-level failure that is not a per-transfer status (e.g. connect failed)."""


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return TORCH_DTYPES[layout.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The KVLayout.dtype name of a torch dtype."""
    for name, dt in TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV cache dtype {dtype}; supported: {sorted(TORCH_DTYPES)}")


def layout_from_cache(
    kv_cache: torch.Tensor,
    block_size: int | None = None,
    scales: Sequence[tuple[float, float]] | None = None,
    layer_windows: Sequence[int | None] = (),
) -> KVLayout:
    """Layout of an engine cache tensor `[L, 2, num_blocks, block_size, Hk, D]`."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must have shape [num_layers, 2, num_blocks, block_size, "
            f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if block_size is not None and block_size != kv_cache.shape[3]:
        raise ValueError(f"block_size={block_size} disagrees with kv_cache.shape[3]={kv_cache.shape[3]}")
    return KVLayout(
        num_layers=int(kv_cache.shape[0]),
        num_kv_heads=int(kv_cache.shape[4]),
        head_dim=int(kv_cache.shape[5]),
        block_size=int(kv_cache.shape[3]),
        dtype=dtype_name(kv_cache.dtype),
        kv_scales=tuple(scales or ()),
        layer_windows=tuple(layer_windows),
    )


def check_cache(layout: KVLayout, kv_cache: torch.Tensor) -> int:
    """Validate a cache tensor against `layout`; returns its number of blocks."""
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    of_cache = layout_from_cache(kv_cache, scales=layout.kv_scales, layer_windows=layout.layer_windows)
    # A tensor-parallel rank's share of the heads is the layout's to say; the tensor has no word on it.
    layout.check_compatible(dataclasses.replace(of_cache, tp_size=layout.tp_size, kv_heads=layout.kv_heads))
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    return int(kv_cache.shape[2])


class TransferStatus(enum.IntEnum):
    """Ordered status of one transfer.

    FAILED < ABORTED < PENDING < TRANSFERRING < SUCCESS. Values >= PENDING increase as a
    transfer progresses; FAILED and ABORTED are terminal, as is SUCCESS. Because failures
    sort lowest, the status of a group of transfers (e.g. all layers of one request) is
    `min(statuses)`.
    """

    FAILED = 0
    ABORTED = 1
    PENDING = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def is_terminal(self) -> bool:
        return self in (TransferStatus.FAILED, TransferStatus.ABORTED, TransferStatus.SUCCESS)


class TransferSide(str, enum.Enum):
    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True)
class TransferHandle:
    """Returned by send()/expect(); pass it back to poll()/wait() on the same transport."""

    transfer_id: str
    role: TransferSide
    num_blocks: int
    nbytes: int
    deadline: float  # time.monotonic() of this process; not meaningful elsewhere

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    role: TransferSide
    status: TransferStatus
    nbytes: int
    seconds: float
    error: str | None = None
    # Why it failed, as a kvtransfer.integrity.FailureReason value (None on success or when the
    # backend could not tell): the label of baton:kv_transfer_failures_total.
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == TransferStatus.SUCCESS


class KVTransport(ABC):
    """Moves KV blocks between two workers' paged caches.

    Lifecycle: `allocate_cache()` (or `register_cache()`) once; publish `endpoint()`; senders
    `connect(peer_endpoint)` once per receiver; then any number of transfers; `close()`.
    Each transfer has a deadline (`timeout_s`); past it the transfer is FAILED and `wait()`
    returns; nothing blocks forever. Thread-safe.
    """

    kind: str = "abstract"

    if TYPE_CHECKING:  # the constructor for_place's default calls (TransportCore's); declared for the checker only

        def __init__(self, checksums: bool = True) -> None: ...

    @classmethod
    def for_place(cls, place: Place, checksums: bool = True) -> KVTransport:
        """This backend for a worker at `place` (how the pairwise transport builds its per-pair
        backends); backends that bind an address override it to use `place.host`."""
        return cls(checksums=checksums)

    @abstractmethod
    def allocate_cache(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        """Allocate and register this worker's cache (backends may place it in shared memory)."""

    @abstractmethod
    def register_cache(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        """Register an existing cache tensor (must match `layout`)."""

    @abstractmethod
    def endpoint(self) -> KVEndpoint:
        """Descriptor a peer passes to `connect()`."""

    @abstractmethod
    def connect(self, peer: KVEndpoint) -> str:
        """Handshake with a receiver; raises KVLayoutMismatch for incompatible layouts.
        Returns the peer id to pass to `send()`. Idempotent."""

    @abstractmethod
    def send(
        self,
        peer_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float,
    ) -> TransferHandle:
        """Start pushing local blocks `src_block_ids` into the peer's `dst_block_ids`.
        Does not wait for the receiver; backends may finish a local copy before returning
        (shm does when the receiver is ready). The source blocks must stay valid until the
        handle is terminal."""

    @abstractmethod
    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> TransferHandle:
        """Receiver side: announce that `transfer_id` will fill `dst_block_ids`."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Current status; marks the transfer FAILED once its deadline has passed."""

    @abstractmethod
    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferResult:
        """Block until the transfer is terminal, its deadline passes (-> FAILED), or
        `timeout_s` elapses (-> the current, possibly non-terminal status)."""

    @abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Abort on this side. On the receiver, once abort() returns no more bytes of this
        transfer are written into the destination blocks, so they may be freed."""

    def set_fault_plan(self, plan) -> None:
        """Inject the faults of a kvtransfer.integrity.FaultPlan into this side's sends (tests);
        None: none. Backends without fault injection refuse."""
        raise NotImplementedError(f"the {self.kind} transport has no fault injection")

    def pending_transfers(self) -> list[str]:
        """Ids of this side's transfers that are not terminal yet."""
        raise NotImplementedError

    def recv_status(self, transfer_id: str) -> TransferStatus:
        """Receiver-side status by id (for callers that did not keep the handle)."""
        return self.poll(self.handle_for(transfer_id, TransferSide.RECV))

    @abstractmethod
    def handle_for(self, transfer_id: str, role: TransferSide) -> TransferHandle:
        """The handle of this side's (`role`) transfer `transfer_id`; ValueError if unknown."""

    @abstractmethod
    def close(self) -> None:
        """Release resources (segments are unlinked, threads stopped); pending -> ABORTED."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
