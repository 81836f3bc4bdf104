"""The state of the shm transport (kvtransfer.shm has the protocol) that both of its halves use: the
receiver's (kvtransfer/_shm_recv.py: our segment and the verifier thread) and the sender's
(kvtransfer/_shm_send.py: the peers' segments, copiers and wake FIFOs, and the queue of sends
waiting for their receiver). Set up here, in the class both halves derive from."""

from __future__ import annotations

import queue
import threading
import uuid

import numpy as np

from kernels.block_checksum import SummingCopier
from kernels.block_copy import KVBlockCopier

from ._common import Record, TransportCore
from ._follower import Follower
from ._segment import Segment
from .integrity import FaultPlan


class ShmCore(TransportCore):
    """The shm transport's state; kvtransfer.shm.ShmTransport adds the segment's and the peers'
    lifetimes."""

    def __init__(
        self,
        num_slots: int = 1024,
        checksums: bool = True,
        fault_plan: FaultPlan | None = None,
        verify_chunk_bytes: int = 256 << 10,
    ) -> None:
        """`verify_chunk_bytes`: how much a sealing send copies (whole blocks, at least one)
        before it tells the receiver, who verifies that much while the next is copied."""
        super().__init__(checksums, fault_plan)
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        if not isinstance(verify_chunk_bytes, int) or verify_chunk_bytes <= 0:
            raise ValueError(f"verify_chunk_bytes must be a positive int, got {verify_chunk_bytes!r}")
        self._num_slots = num_slots
        self._verify_chunk_bytes, self._chunk_blocks = verify_chunk_bytes, 1  # blocks: set with the layout
        self._worker_id = f"shm-{uuid.uuid4().hex[:12]}"
        self._own: Segment | None = None
        self._peers: dict[str, Segment] = {}
        self._jobs: queue.Queue[Record | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._rows: np.ndarray | None = None  # block_rows() of our cache, when on the CPU
        # Per peer: the native copy from our cache into its segment, when our cache is on the CPU.
        self._copiers: dict[str, KVBlockCopier | None] = {}
        self._summing: dict[str, SummingCopier | None] = {}  # the same, summing as it copies
        self._wakers: dict[str, int | None] = {}  # per peer: the write end of its FIFO
        # Receiver: the read end of our FIFO, and the verifier thread (kvtransfer._follower).
        self._wake_fd: int | None = None
        self._follower: Follower[Record] | None = None
