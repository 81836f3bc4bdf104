"""Shared-memory backend for workers on one node.

The receiver's cache lives in a shared memory file (`/dev/shm/baton_kv_*`, a temp file where
there is no /dev/shm). A sender maps it and copies its blocks straight into the reserved
slots with one native call (kernels/csrc/kv_block_copy.cpp; numpy per run of consecutive ids
when native kernels are off), no staging buffer.

Completion and aborts go through a slot table in the same segment, in front of the cache:
the receiver's `expect()` writes (key, PENDING, dst-id fingerprint), preferably into the
slot at `key % num_slots` so that the sender finds it without scanning the table; the sender
moves it PENDING -> TRANSFERRING -> SUCCESS around its copy. Every state change, and the whole
copy, happens under an flock on the segment file plus a thread lock, so a receiver's abort
either happens before the copy (the sender then writes nothing) or waits for it.

Integrity (kvtransfer.integrity): the native copy sums each source block as it copies it; the
sender writes one seal per block into a table beside the slots (indexed by destination block)
and its manifest (key, layout tag, blocks vouched for) into the slot, before SUCCESS. The
receiver sums the blocks in its own cache, overlapping the copy (kvtransfer._follower says how),
and compares before it reports SUCCESS itself; a mismatch is FAILED with its reason. The
sender's own SUCCESS means "copied"; only the receiver can say "verified". A sender with
checksums off runs the same native copy without the sums, so that turning them on adds the sums
and the receiver's check, nothing else.

When the receiver has already called `expect()` (the normal order), `send()` does the copy in
the caller's thread and returns a terminal handle; only a send that arrives first is handed
to a background thread, which retries until the slot appears or the deadline passes.

The owner unlinks the segment and its FIFO on close(); both are also registered with Python's
resource tracker, which unlinks them if the owning process exits without closing. A process that is
killed (Ray kills an actor's children too, tracker included) leaves its segment behind;
`sweep_stale_segments()`, run by every new allocation, unlinks segments whose owner (pid and
start time, recorded in the header) no longer exists.
"""

from __future__ import annotations

import os
import uuid
from multiprocessing import resource_tracker

import numpy as np
import torch

from common.protocol import KVEndpoint, KVLayout
from kernels.block_checksum import SummingCopier
from kernels.block_checksum import native_available as native_sums_available
from kernels.block_copy import KVBlockCopier, copy_native_available

from ._common import block_rows
from ._follower import Follower
from ._segment import HEADER_INTS as _HEADER_INTS
from ._segment import MAGIC as _MAGIC
from ._segment import Segment as _Segment
from ._segment import layout_bytes as _layout_bytes
from ._segment import make_wake_fifo, open_peer_segment, open_waker, sweep_stale_segments, wake_path
from ._segment import map_segment as _map
from ._segment import process_start as _process_start
from ._segment import shm_dir as _shm_dir
from ._shm_recv import ShmReceiver
from ._shm_send import ShmSender
from .base import torch_dtype


class ShmTransport(ShmReceiver, ShmSender):
    """Both sides of the protocol above over one segment of our own (the receiver's half in
    kvtransfer/_shm_recv.py, the sender's in kvtransfer/_shm_send.py, the state they share and
    the constructor in kvtransfer/_shm_core.py); here: the segment's and the peers' lifetimes."""

    kind = "shm"

    # -- cache ---------------------------------------------------------------------------
    def allocate_cache(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        self._check_num_blocks(num_blocks)
        if self._cache is not None:
            raise ValueError("shm transport already has a registered cache")
        offset, nbytes = _layout_bytes(layout, num_blocks, self._num_slots)
        sweep_stale_segments()
        path = os.path.join(_shm_dir(), f"baton_kv_{uuid.uuid4().hex[:16]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, offset + nbytes)  # zero-filled by the kernel
            seg = _map(path, fd, offset + nbytes, layout, num_blocks, self._num_slots, True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        header = np.ndarray((_HEADER_INTS,), dtype=np.int64, buffer=seg.mm)
        pid = os.getpid()
        header[:7] = (_MAGIC, self._num_slots, num_blocks, offset, nbytes, pid, _process_start(pid) or -1)
        self._own = seg
        self._wake_fd = make_wake_fifo(path)
        for name in self._tracked_names(seg):
            # Unlinks the segment and its FIFO if this process dies without close().
            resource_tracker.register(name, "shared_memory")
        self._follower = Follower(self._wake_fd, self._look, lambda: self._closed)
        cache = seg.cache_bytes.view(torch_dtype(layout))
        self.register_cache(cache, layout)
        return cache

    def register_cache(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        super().register_cache(kv_cache, layout)
        if self._bytes is not None and self._bytes.device.type == "cpu":
            self._rows = block_rows(self._bytes)
        self._chunk_blocks = max(1, self._verify_chunk_bytes // layout.block_bytes)

    def endpoint(self) -> KVEndpoint:
        _, layout = self._require_cache()
        address: dict[str, object] = {
            "path": None if self._own is None else self._own.path,
            "num_slots": self._num_slots,
        }
        return KVEndpoint(self.kind, self._worker_id, layout, self._num_blocks, address)

    def connect(self, peer: KVEndpoint) -> str:
        ours, layout = self._require_cache()
        if peer.kind != self.kind:
            raise ValueError(f"cannot connect a {self.kind} transport to a {peer.kind} endpoint")
        layout.check_compatible(peer.layout)
        if peer.worker_id in self._peers:
            return peer.worker_id
        path = peer.address.get("path")
        if path is None:
            raise ValueError(
                f"peer {peer.worker_id} registered a private cache; only caches made "
                "by ShmTransport.allocate_cache() can receive over shm"
            )
        num_slots = peer.address.get("num_slots")
        if not isinstance(path, str) or not isinstance(num_slots, int):
            raise ValueError(
                f"peer {peer.worker_id}'s shm address is not a segment path and slot count: {peer.address}"
            )
        self._forget_exited_peers()
        seg = open_peer_segment(path, peer.layout, peer.num_blocks, num_slots, peer.worker_id)
        self._peers[peer.worker_id] = seg
        self._copiers[peer.worker_id] = (
            KVBlockCopier(seg.cache_bytes, ours) if copy_native_available(seg.cache_bytes, ours) else None
        )
        self._summing[peer.worker_id] = (
            SummingCopier(seg.cache_bytes, ours) if native_sums_available(seg.cache_bytes, ours) else None
        )
        self._wakers[peer.worker_id] = open_waker(path)
        return peer.worker_id

    def _forget_exited_peers(self) -> None:
        """Drop the receivers whose process has exited (a restarted, replaced or removed decode
        worker): their segment's memory returns to the system once no send still holds its mapping."""
        with self._lock:
            records = list(self._records.values())
        busy = {id(r.extra.get("seg")) for r in records if not r.status.is_terminal}
        exited = {p: seg for p, seg in self._peers.items() if id(seg) not in busy and not seg.owner_alive()}
        for peer_id in exited:
            self._drop_peer(peer_id)
        dropped = {id(seg) for seg in exited.values()}
        for rec in records:  # finished sends kept for their status must not keep the mapping alive
            if rec.status.is_terminal and id(rec.extra.get("seg")) in dropped:
                rec.extra.clear()

    def _drop_peer(self, peer_id: str) -> None:
        os.close(self._peers.pop(peer_id).fd)
        waker = self._wakers.pop(peer_id, None)
        if waker is not None:
            os.close(waker)
        self._copiers.pop(peer_id, None)
        self._summing.pop(peer_id, None)

    def peers(self) -> list[str]:
        """The receivers this transport holds a mapping of."""
        return list(self._peers)

    # -- teardown --------------------------------------------------------------------------
    def _tracked_names(self, seg: _Segment) -> list[str]:
        """Our segment's files as the resource tracker names POSIX shared memory (/dev/shm only):
        the segment, and its FIFO where there is one."""
        if not seg.path.startswith("/dev/shm/"):
            return []
        paths = [seg.path] + ([wake_path(seg.path)] if self._wake_fd is not None else [])
        return ["/" + os.path.basename(p) for p in paths]

    def close(self) -> None:
        if self._closed:
            return
        self._abort_all("shm transport closed")
        self._closed = True
        self._jobs.put(None)
        if self._worker is not None:
            self._worker.join(timeout=2.0)
        if self._follower is not None:
            self._follower.stop()
        for peer_id in list(self._peers):
            self._drop_peer(peer_id)
        seg, self._own = self._own, None
        if seg is not None:
            os.close(seg.fd)
            for path in (seg.path, wake_path(seg.path)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            for name in self._tracked_names(seg):
                resource_tracker.unregister(name, "shared_memory")
            if self._wake_fd is not None:
                os.close(self._wake_fd)
                self._wake_fd = None
        # Mappings stay valid while tensors (e.g. the engine's cache) still reference them;
        # the memory is returned when the last one is dropped.
        self._cache = self._bytes = None
