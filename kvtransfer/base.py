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
bit-exact; the handshake makes sure both sides interpret those bytes the same way.
"""

from __future__ import annotations

import enum
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

# Dtype names accepted in KVLayout.dtype, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
FP8_DTYPES = frozenset({"float8_e4m3fn"})


class KVLayoutMismatch(ValueError):
    """Two workers' KV caches cannot exchange blocks; the message names the field."""


class KVTransferError(RuntimeError):
    """A transport-level failure that is not a per-transfer status (e.g. connect failed)."""


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV cache dtype {dtype}; supported: {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """Everything both ends must agree on for raw block bytes to mean the same thing.

    `kv_scales` holds one (k_scale, v_scale) pair per layer for FP8 caches; it is empty for
    other dtypes (scales of 1.0 are normalised to empty, so "no scales" and "all ones" agree).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_scales: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        scales = tuple((float(k), float(v)) for k, v in self.kv_scales)
        if scales and len(scales) != self.num_layers:
            raise ValueError(
                f"KVLayout.kv_scales has {len(scales)} entries, expected one (k, v) pair per "
                f"layer ({self.num_layers})"
            )
        for i, (k, v) in enumerate(scales):
            if not (math.isfinite(k) and math.isfinite(v) and k > 0 and v > 0):
                raise ValueError(f"KVLayout.kv_scales[{i}] = {(k, v)} must be finite and > 0")
        if all(k == 1.0 and v == 1.0 for k, v in scales):
            scales = ()
        object.__setattr__(self, "kv_scales", scales)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        # dtype.itemsize, not a tensor's element_size(): making a tensor costs ~15 us in a
        # process that was just woken up, and block_bytes is on every transfer's path.
        return self.torch_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all layers, K and V."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
            * self.element_size
        )

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def from_cache(
        cls,
        kv_cache: torch.Tensor,
        block_size: Optional[int] = None,
        scales: Optional[Sequence[tuple[float, float]]] = None,
    ) -> "KVLayout":
        """Layout of an engine cache tensor `[L, 2, num_blocks, block_size, Hk, D]`."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must have shape [num_layers, 2, num_blocks, block_size, "
                f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
            )
        if block_size is not None and block_size != kv_cache.shape[3]:
            raise ValueError(
                f"block_size={block_size} disagrees with kv_cache.shape[3]={kv_cache.shape[3]}"
            )
        return cls(
            num_layers=int(kv_cache.shape[0]),
            num_kv_heads=int(kv_cache.shape[4]),
            head_dim=int(kv_cache.shape[5]),
            block_size=int(kv_cache.shape[3]),
            dtype=_dtype_name(kv_cache.dtype),
            kv_scales=tuple(scales or ()),
        )

    def check_cache(self, kv_cache: torch.Tensor) -> int:
        """Validate a cache tensor against this layout; returns its number of blocks."""
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        other = KVLayout.from_cache(kv_cache, scales=self.kv_scales)
        self.check_compatible(other)
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        return int(kv_cache.shape[2])

    def check_compatible(self, peer: "KVLayout") -> None:
        """Raise KVLayoutMismatch naming the first field that differs (ours vs the peer's)."""
        if not isinstance(peer, KVLayout):
            raise KVLayoutMismatch(f"peer layout is {type(peer).__name__}, not KVLayout")
        checks = (
            ("dtype", self.dtype, peer.dtype),
            ("block_size", self.block_size, peer.block_size),
            ("num_layers", self.num_layers, peer.num_layers),
            ("num_kv_heads", self.num_kv_heads, peer.num_kv_heads),
            ("head_dim", self.head_dim, peer.head_dim),
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


class Role(str, enum.Enum):
    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True)
class TransferHandle:
    """Returned by send()/expect(); pass it back to poll()/wait() on the same transport."""

    transfer_id: str
    role: Role
    num_blocks: int
    nbytes: int
    deadline: float  # time.monotonic() of this process; not meaningful elsewhere

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    role: Role
    status: TransferStatus
    nbytes: int
    seconds: float
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status == TransferStatus.SUCCESS


@dataclass(frozen=True)
class KVEndpoint:
    """Picklable description of a worker's cache, sent to peers by the caller (e.g. via Ray).

    `address` is backend-specific (segment name, store host/port); `kind` names the backend.
    """

    kind: str
    worker_id: str
    layout: KVLayout
    num_blocks: int
    address: dict = field(default_factory=dict, compare=False)


class KVTransport(ABC):
    """Moves KV blocks between two workers' paged caches.

    Lifecycle: `allocate_cache()` (or `register_cache()`) once; publish `endpoint()`; senders
    `connect(peer_endpoint)` once per receiver; then any number of transfers; `close()`.
    Each transfer has a deadline (`timeout_s`); past it the transfer is FAILED and `wait()`
    returns; nothing blocks forever. Thread-safe.
    """

    kind: str = "abstract"

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
    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float
    ) -> TransferHandle:
        """Receiver side: announce that `transfer_id` will fill `dst_block_ids`."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Current status; marks the transfer FAILED once its deadline has passed."""

    @abstractmethod
    def wait(self, handle: TransferHandle, timeout_s: Optional[float] = None) -> TransferResult:
        """Block until the transfer is terminal, its deadline passes (-> FAILED), or
        `timeout_s` elapses (-> the current, possibly non-terminal status)."""

    @abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Abort on this side. On the receiver, once abort() returns no more bytes of this
        transfer are written into the destination blocks, so they may be freed."""

    def recv_status(self, transfer_id: str) -> TransferStatus:
        """Receiver-side status by id (for callers that did not keep the handle)."""
        return self.poll(self._handle_for(transfer_id, Role.RECV))

    @abstractmethod
    def _handle_for(self, transfer_id: str, role: Role) -> TransferHandle: ...

    @abstractmethod
    def close(self) -> None:
        """Release resources (segments are unlinked, threads stopped); pending -> ABORTED."""

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
