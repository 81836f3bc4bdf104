"""The pair protocol shared by the gloo and NCCL transports: the messages a sender and a
receiver exchange through the receiver's control store, how a payload is cut into chunks,
the reusable staging buffer, and each side's per-pair state."""

from __future__ import annotations

import datetime
import queue
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from common.protocol import KVLayout

from ._common import Record
from ._control import ControlClient
from .integrity import Manifest


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


@dataclass(frozen=True)
class ConnRequest:
    pair: str
    worker_id: str
    layout: KVLayout
    num_blocks: int


@dataclass(frozen=True)
class XferMsg:
    kind: str  # "xfer" or "close"
    transfer_id: str = ""
    nblocks: int = 0
    nbytes: int = 0
    dst_hash: int = 0
    remaining_s: float = 0.0
    chunk_blocks: int = 1
    sealed: bool = False  # a kvtransfer.integrity.Manifest follows the last chunk in the store


# Payloads are cut into chunks of about this size so that packing, the wire and unpacking
# overlap.
CHUNK_BYTES = 4 << 20


def chunk_spans(nblocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    return [(a, min(chunk_blocks, nblocks - a)) for a in range(0, nblocks, chunk_blocks)]


class Staging:
    """Grow-only flat byte buffer reused across transfers of one pair."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.buf[:nbytes]


class PairGroup(Protocol):
    """A pair's two-rank process group, as the transports use it (torch's stubs give the backends'
    process groups no send or recv)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...


@dataclass
class OutPair:
    """Sender side of a pair."""

    peer_id: str
    pair: str
    store: ControlClient  # used by the send thread only
    group: PairGroup | None  # None once the pair broke on an injected kill (its sockets close)
    peer_num_blocks: int
    jobs: queue.Queue[Record | None] = field(default_factory=queue.Queue)
    in_flight: dict[int, Record] = field(default_factory=dict)  # seq -> Record awaiting a verdict
    threads: list[threading.Thread] = field(default_factory=list)
    broken: str | None = None


@dataclass
class Parked:
    msg: XferMsg
    seq: int
    buf: torch.Tensor
    timer: threading.Timer
    manifest: Manifest | None = None  # the sender's (None: not sealed)


@dataclass
class InPair:
    """Receiver side of a pair."""

    pair: str
    reply_store: ControlClient
    reply_lock: threading.Lock = field(default_factory=threading.Lock)
    next_seq: int = 0
    parked: dict[str, Parked] = field(default_factory=dict)  # transfer_id -> Parked
