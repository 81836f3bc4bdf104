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

When the receiver has already called `expect()` (the normal order), `send()` does the copy in
the caller's thread and returns a terminal handle; only a send that arrives first is handed
to a background thread, which retries until the slot appears or the deadline passes.

The owner unlinks the segment on close(); it is also registered with Python's resource
tracker, which unlinks it if the owning process exits without closing. A process that is
killed (Ray kills an actor's children too, tracker included) leaves its segment behind;
`sweep_stale_segments()`, run by every new allocation, unlinks segments whose owner (pid and
start time, recorded in the header) no longer exists.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import queue
import struct
import tempfile
import threading
import time
import uuid
from array import array
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Optional, Sequence

import numpy as np
import torch

from kernels.block_copy import KVBlockCopier, copy_native_available
from common.protocol import KVEndpoint, KVLayout

from ._common import (
    Record,
    TransportCore,
    block_rows,
    byte_view,
    coalesce,
    copy_blocks,
    copy_runs,
    ids_hash,
    transfer_key,
)
from .base import KVTransferError, Role, TransferHandle, TransferStatus, torch_dtype

_MAGIC = 0x4B56_4241_544F_4E31  # "KVBATON1"
_HEADER_INTS = 8
# key, state, dst-id fingerprint, num_blocks, reason, receiver deadline (CLOCK_MONOTONIC ns,
# which is system-wide, so both processes on the node can compare it)
_SLOT_COLS = 6
_KEY, _STATE, _HASH, _NBLOCKS, _REASON, _DEADLINE = range(_SLOT_COLS)
_REASONS = {
    0: "",
    1: "sender's dst_block_ids differ from the receiver's",
    2: "aborted by the sender",
    3: "aborted by the receiver",
    4: "receiver deadline passed",
}
_PAGE = 4096
# Plain ints for the states the send path compares against (an IntEnum round trip per field
# read is measurable at this scale).
_PENDING = int(TransferStatus.PENDING)
_TRANSFERRING = int(TransferStatus.TRANSFERRING)
_SUCCESS = int(TransferStatus.SUCCESS)
_FAILED = int(TransferStatus.FAILED)
_ABORTED = int(TransferStatus.ABORTED)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _process_start(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of a live process, None if it does not exist;
    with the pid it identifies a process even after pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def sweep_stale_segments(directory: Optional[str] = None) -> list[str]:
    """Unlink this user's Baton KV segments whose owning process is gone; returns them."""
    directory = directory or _shm_dir()
    removed: list[str] = []
    if not os.path.isdir("/proc"):
        return removed  # liveness cannot be told here
    for name in os.listdir(directory):
        if not name.startswith("baton_kv_"):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(path, "rb") as f:
                head = f.read(7 * 8)
        except OSError:
            continue
        if len(head) < 7 * 8:
            continue
        magic, _, _, _, _, pid, start = struct.unpack("<7q", head)
        if magic != _MAGIC or pid <= 0:
            continue  # header not written yet: being created
        if _process_start(pid) == start:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


@dataclass
class _Segment:
    """A mapped segment: slot table + cache bytes."""

    path: str
    fd: int
    mm: mmap.mmap
    slots: np.ndarray
    cache_bytes: torch.Tensor  # uint8 [L, 2, N, bs, Hk, D * itemsize]
    rows: np.ndarray  # block_rows(cache_bytes), made once: the send path copies through it
    owner: bool
    thread_lock: threading.Lock

    def locked(self) -> "_Segment":
        """`with seg.locked():` holds the segment lock (a plain context manager, not a
        generator one: this is on every transfer's path)."""
        return self

    def __enter__(self) -> "_Segment":
        # flock excludes other processes (and other open()s); the thread lock excludes
        # threads sharing this fd, which flock does not.
        self.thread_lock.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.thread_lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.thread_lock.release()

    def find(self, key: int) -> int:
        """Slot holding `key`, or -1. Looks at the key's home slot first (where expect()
        puts it unless taken): a scan of the whole table is slow in a process that was
        just woken up."""
        home = key % len(self.slots)
        if self.slots[home, _KEY] == key:
            return home
        found = np.flatnonzero(self.slots[:, _KEY] == key)
        return int(found[0]) if len(found) else -1


def _layout_bytes(layout: KVLayout, num_blocks: int, num_slots: int) -> tuple[int, int]:
    table = _HEADER_INTS * 8 + num_slots * _SLOT_COLS * 8
    offset = (table + _PAGE - 1) // _PAGE * _PAGE
    return offset, num_blocks * layout.block_bytes


def _map(path: str, fd: int, size: int, layout: KVLayout, num_blocks: int, num_slots: int,
         owner: bool) -> _Segment:
    # MAP_POPULATE: build the page tables now. Otherwise the first copy into each page of a
    # peer's cache pays a page fault.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=flags)
    offset, nbytes = _layout_bytes(layout, num_blocks, num_slots)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    shape = layout.cache_shape(num_blocks)
    cache = raw[offset:offset + nbytes].view(torch_dtype(layout)).view(shape)
    slots = np.ndarray((num_slots, _SLOT_COLS), dtype=np.int64, buffer=mm, offset=_HEADER_INTS * 8)
    cache_bytes = byte_view(cache)
    return _Segment(path, fd, mm, slots, cache_bytes, block_rows(cache_bytes), owner,
                    threading.Lock())


class ShmTransport(TransportCore):
    kind = "shm"

    def __init__(self, num_slots: int = 1024) -> None:
        super().__init__()
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self._num_slots = num_slots
        self._worker_id = f"shm-{uuid.uuid4().hex[:12]}"
        self._own: Optional[_Segment] = None
        self._peers: dict[str, _Segment] = {}
        self._peer_blocks: dict[str, int] = {}
        self._jobs: "queue.Queue[Optional[Record]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._rows: Optional[np.ndarray] = None  # block_rows() of our cache, when on the CPU
        # Per peer: the native copy from our cache into its segment, when our cache is on the CPU.
        self._copiers: dict[str, Optional[KVBlockCopier]] = {}

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
        if path.startswith("/dev/shm/"):
            # Unlinks the segment if this process dies without close().
            resource_tracker.register("/" + os.path.basename(path), "shared_memory")
        header = np.ndarray((_HEADER_INTS,), dtype=np.int64, buffer=seg.mm)
        pid = os.getpid()
        header[:7] = (_MAGIC, self._num_slots, num_blocks, offset, nbytes, pid,
                      _process_start(pid) or -1)
        self._own = seg
        cache = seg.cache_bytes.view(torch_dtype(layout))
        self.register_cache(cache, layout)
        return cache

    def register_cache(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        super().register_cache(kv_cache, layout)
        if self._bytes is not None and self._bytes.device.type == "cpu":
            self._rows = block_rows(self._bytes)

    def endpoint(self) -> KVEndpoint:
        _, layout = self._require_cache()
        address = {"path": None if self._own is None else self._own.path,
                   "num_slots": self._num_slots}
        return KVEndpoint(self.kind, self._worker_id, layout, self._num_blocks, address)

    def connect(self, peer: KVEndpoint) -> str:
        _, layout = self._require_cache()
        if peer.kind != self.kind:
            raise ValueError(f"cannot connect a {self.kind} transport to a {peer.kind} endpoint")
        layout.check_compatible(peer.layout)
        if peer.worker_id in self._peers:
            return peer.worker_id
        path = peer.address.get("path")
        if path is None:
            raise ValueError(f"peer {peer.worker_id} registered a private cache; only caches made "
                             "by ShmTransport.allocate_cache() can receive over shm")
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise KVTransferError(f"shared memory segment {path} of peer {peer.worker_id} does "
                                  "not exist (peer closed, or on another node?)") from None
        num_slots = int(peer.address["num_slots"])
        offset, nbytes = _layout_bytes(peer.layout, peer.num_blocks, num_slots)
        size = os.fstat(fd).st_size
        if size != offset + nbytes:
            os.close(fd)
            raise KVTransferError(f"segment {path} has {size} bytes, expected {offset + nbytes}")
        seg = _map(path, fd, size, peer.layout, peer.num_blocks, num_slots, False)
        header = np.ndarray((_HEADER_INTS,), dtype=np.int64, buffer=seg.mm)
        if int(header[0]) != _MAGIC or int(header[2]) != peer.num_blocks:
            os.close(fd)
            raise KVTransferError(f"segment {path} is not a Baton KV cache of {peer.num_blocks} "
                                  "blocks")
        self._peers[peer.worker_id] = seg
        self._peer_blocks[peer.worker_id] = peer.num_blocks
        self._copiers[peer.worker_id] = KVBlockCopier(seg.cache_bytes, self._bytes) \
            if copy_native_available(seg.cache_bytes, self._bytes) else None
        return peer.worker_id

    # -- receiver --------------------------------------------------------------------------
    def expect(self, transfer_id: str, dst_block_ids: Sequence[int],
               timeout_s: float) -> TransferHandle:
        dst, timeout_s = self._prepare_expect(transfer_id, dst_block_ids, timeout_s)
        seg = self._own
        if seg is None:
            raise ValueError("this shm transport's cache was registered, not allocated in shared "
                             "memory, so it cannot receive")
        rec = self._new_record(transfer_id, Role.RECV, dst, timeout_s)
        if rec.status.is_terminal:
            return rec.handle()
        key = transfer_key(transfer_id)
        with seg.locked():
            slot = self._free_slot(seg, key)
            seg.slots[slot, _HASH] = ids_hash(dst)
            seg.slots[slot, _NBLOCKS] = len(dst)
            seg.slots[slot, _REASON] = 0
            seg.slots[slot, _DEADLINE] = int(rec.deadline * 1e9)
            seg.slots[slot, _STATE] = int(TransferStatus.PENDING)
            seg.slots[slot, _KEY] = key  # last: senders look slots up by key
        rec.extra["slot"] = slot
        return rec.handle()

    def _free_slot(self, seg: _Segment, key: int) -> int:
        # A slot already holding this key (an id reused after its earlier transfer ended)
        # is taken again, so that a key is never in two slots; otherwise the home slot.
        slot = seg.find(key)
        if slot >= 0:
            return slot
        keys = seg.slots[:, _KEY]
        home = key % len(keys)
        if keys[home] == 0:
            return home
        candidates = np.flatnonzero(keys == 0)
        if len(candidates):
            return int(candidates[0])
        # Reclaim slots left terminal for late senders, if no live local record owns them.
        with self._lock:
            live = {r.extra.get("slot") for r in self._records.values()
                    if r.role == Role.RECV and not r.status.is_terminal}
        for i in range(len(keys)):
            if i not in live and TransferStatus(int(seg.slots[i, _STATE])).is_terminal:
                return i
        raise KVTransferError(f"all {len(keys)} shm transfer slots are in use; raise num_slots")

    def _refresh(self, rec: Record) -> None:
        if rec.role != Role.RECV or rec.status.is_terminal or "slot" not in rec.extra:
            return
        seg, slot = self._own, rec.extra["slot"]
        state = TransferStatus(int(seg.slots[slot, _STATE]))
        if state == TransferStatus.TRANSFERRING:
            self._set_transferring(rec)
        elif state.is_terminal:
            reason = _REASONS.get(int(seg.slots[slot, _REASON]), "")
            error = None if state == TransferStatus.SUCCESS else (reason or state.name.lower())
            self._finish(rec, state, error)
            with seg.locked():
                if seg.slots[slot, _KEY] == transfer_key(rec.transfer_id) and state == \
                        TransferStatus.SUCCESS:
                    seg.slots[slot, _KEY] = 0

    def _terminate(self, rec: Record, status: TransferStatus, error: str) -> None:
        if rec.role != Role.RECV or "slot" not in rec.extra or self._own is None:
            super()._terminate(rec, status, error)
            return
        self._cancel(rec)
        seg, slot = self._own, rec.extra["slot"]
        # Taking the segment lock waits for a sender's in-progress copy to end.
        with seg.locked():
            if seg.slots[slot, _KEY] == transfer_key(rec.transfer_id):
                state = TransferStatus(int(seg.slots[slot, _STATE]))
                if state == TransferStatus.SUCCESS:
                    self._finish(rec, TransferStatus.SUCCESS)  # fully landed before the abort
                    return
                if not state.is_terminal:
                    seg.slots[slot, _STATE] = int(status)
                    seg.slots[slot, _REASON] = 3 if status == TransferStatus.ABORTED else 4
            self._finish(rec, status, error)

    # -- sender ----------------------------------------------------------------------------
    def send(self, peer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             transfer_id: str, timeout_s: float) -> TransferHandle:
        """If the receiver has already called expect(), the copy happens before this
        returns (the handle is then terminal); otherwise a worker thread does it once the
        receiver's slot appears."""
        self._require_cache()
        seg = self._peers.get(peer_id)
        if seg is None:
            raise ValueError(f"unknown peer {peer_id!r}: call connect() with its endpoint first")
        src, dst, timeout_s = self._prepare_send(self._peer_blocks[peer_id], src_block_ids,
                                                 dst_block_ids, transfer_id, timeout_s)
        rec = self._new_record(transfer_id, Role.SEND, src, timeout_s)
        if rec.status.is_terminal:
            return rec.handle()
        # Everything the copy needs is worked out before the segment lock is taken.
        rec.extra.update(seg=seg, copier=self._copiers[peer_id], key=transfer_key(transfer_id),
                         nblocks=len(dst), dst_hash=ids_hash(dst), dst=dst)
        # Common case: the receiver reserved and expect()ed first. Copy right here: one
        # memcpy, no thread hand-off.
        if not self._try_send(rec):
            with self._lock:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._send_worker, daemon=True,
                                                    name="kv-shm-send")
                    self._worker.start()
            self._jobs.put(rec)
        return rec.handle()

    def _send_worker(self) -> None:
        """Runs the sends that found no receiver slot yet. One long-lived thread, because
        torch's copy pays for a new OpenMP team in every new thread. Sends whose receiver has
        not called expect() yet stay pending without blocking the others."""
        pending: list[Record] = []
        pause = 2e-5
        while True:
            jobs: list[Optional[Record]] = []
            try:
                jobs.append(self._jobs.get(timeout=pause if pending else None))
                while True:
                    jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            if None in jobs:
                return
            pending.extend(jobs)
            before = len(pending)
            pending = [rec for rec in pending if not self._try_send(rec)]
            pause = 2e-5 if len(pending) < before else min(pause * 2, 0.002)

    def _try_send(self, rec: Record) -> bool:
        """One attempt; True once `rec` needs no more work."""
        if rec.status.is_terminal:
            return True
        extra = rec.extra
        seg: _Segment = extra["seg"]
        key = extra["key"]
        slot = seg.find(key)
        if slot < 0:
            # The receiver's expect() normally precedes send(); until it comes, wait.
            if time.monotonic() > rec.deadline:
                self._finish(rec, TransferStatus.FAILED,
                             f"receiver never expected transfer {rec.transfer_id!r}")
                return True
            return False
        with seg.locked(), rec.mem_lock:
            row = seg.slots[slot]
            slot_key, state, dst_hash, nblocks, reason, deadline = row.tolist()
            if slot_key != key:
                return False  # reclaimed meanwhile; look again
            if state != _PENDING:
                why = _REASONS.get(reason, "") or TransferStatus(state).name.lower()
                status = TransferStatus(state) if state in (_ABORTED, _FAILED) \
                    else TransferStatus.FAILED
                self._finish(rec, status, f"receiver side: {why}")
                return True
            if time.monotonic_ns() > deadline:
                row[_STATE], row[_REASON] = _FAILED, 4
                self._finish(rec, TransferStatus.FAILED, f"receiver side: {_REASONS[4]}")
                return True
            if dst_hash != extra["dst_hash"] or nblocks != extra["nblocks"]:
                row[_STATE], row[_REASON] = _FAILED, 1
                self._finish(rec, TransferStatus.FAILED,
                             f"transfer {rec.transfer_id!r}: {_REASONS[1]}")
                return True
            if rec.status.is_terminal:  # aborted/expired on this side before the copy
                row[_STATE], row[_REASON] = _ABORTED, 2
                return True
            row[_STATE] = _TRANSFERRING
            # Only a holder of rec.mem_lock moves a send record on (abort and expiry take it
            # too), so no need for the transport lock here.
            rec.status = TransferStatus.TRANSFERRING
            copier = extra["copier"]
            if copier is not None:
                copier(array("q", extra["dst"]), array("q", rec.block_ids))
            elif self._rows is not None:  # native kernels off or unbuildable
                copy_runs(seg.rows, self._rows, coalesce(rec.block_ids, extra["dst"]))
            else:  # a registered cache on another device
                copy_blocks(seg.cache_bytes, extra["dst"], self._bytes, rec.block_ids)
            row[_STATE] = _SUCCESS
            self._finish(rec, TransferStatus.SUCCESS)
        return True

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._abort_all("shm transport closed")
        self._closed = True
        self._jobs.put(None)
        if self._worker is not None:
            self._worker.join(timeout=2.0)
        for seg in self._peers.values():
            os.close(seg.fd)
        self._peers.clear()
        self._copiers.clear()
        seg, self._own = self._own, None
        if seg is not None:
            os.close(seg.fd)
            try:
                os.unlink(seg.path)
            except FileNotFoundError:
                pass
            if seg.path.startswith("/dev/shm/"):
                resource_tracker.unregister("/" + os.path.basename(seg.path), "shared_memory")
        # Mappings stay valid while tensors (e.g. the engine's cache) still reference them;
        # the memory is returned when the last one is dropped.
        self._cache = self._bytes = None
