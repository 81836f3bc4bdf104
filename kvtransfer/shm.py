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
import queue
import threading
import time
import uuid
from array import array
from collections.abc import Sequence
from multiprocessing import resource_tracker

import numpy as np
import torch

from common.protocol import KVEndpoint, KVLayout
from kernels.block_checksum import SummingCopier
from kernels.block_checksum import native_available as native_sums_available
from kernels.block_copy import KVBlockCopier, copy_native_available

from ._common import (
    Record,
    TransportCore,
    block_rows,
    coalesce,
    copy_blocks,
    copy_runs,
    ids_hash,
    transfer_key,
)
from ._follower import FOLLOW_WAIT_S, STALLED_S, Follower, Progress, wake
from ._segment import DEADLINE as _DEADLINE
from ._segment import HASH as _HASH
from ._segment import HEADER_INTS as _HEADER_INTS
from ._segment import KEY as _KEY
from ._segment import LANDED as _LANDED
from ._segment import MAGIC as _MAGIC
from ._segment import NBLOCKS as _NBLOCKS
from ._segment import REASON as _REASON
from ._segment import REASON_KINDS as _REASON_KINDS
from ._segment import REASONS as _REASONS
from ._segment import SENT_BLOCKS as _SENT_BLOCKS
from ._segment import SENT_KEY as _SENT_KEY
from ._segment import SENT_TAG as _SENT_TAG
from ._segment import STATE as _STATE
from ._segment import UNSEALED as _UNSEALED
from ._segment import Segment as _Segment
from ._segment import layout_bytes as _layout_bytes
from ._segment import make_wake_fifo, open_peer_segment, open_waker, sweep_stale_segments, wake_path
from ._segment import map_segment as _map
from ._segment import process_start as _process_start
from ._segment import shm_dir as _shm_dir
from ._shm_faults import faulty_copy
from .base import Role, TransferHandle, TransferStatus, torch_dtype
from .integrity import FailureReason, Fault, FaultKind, FaultPlan, Manifest, faulty_manifest

# Plain ints for the states the send path compares against (an IntEnum round trip per field
# read is measurable at this scale).
_PENDING = int(TransferStatus.PENDING)
_TRANSFERRING = int(TransferStatus.TRANSFERRING)
_SUCCESS = int(TransferStatus.SUCCESS)
_FAILED = int(TransferStatus.FAILED)
_ABORTED = int(TransferStatus.ABORTED)


class ShmTransport(TransportCore):
    kind = "shm"

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
        self._own: _Segment | None = None
        self._peers: dict[str, _Segment] = {}
        self._jobs: queue.Queue[Record | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._rows: np.ndarray | None = None  # block_rows() of our cache, when on the CPU
        # Per peer: the native copy from our cache into its segment, when our cache is on the CPU.
        self._copiers: dict[str, KVBlockCopier | None] = {}
        self._summing: dict[str, SummingCopier | None] = {}  # the same, summing as it copies
        self._wakers: dict[str, int | None] = {}  # per peer: the write end of its FIFO
        # Receiver: the read end of our FIFO, and the verifier thread (kvtransfer._follower).
        self._wake_fd: int | None = None
        self._follower: Follower | None = None

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
        address = {"path": None if self._own is None else self._own.path, "num_slots": self._num_slots}
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
            raise ValueError(
                f"peer {peer.worker_id} registered a private cache; only caches made "
                "by ShmTransport.allocate_cache() can receive over shm"
            )
        self._forget_exited_peers()
        seg = open_peer_segment(path, peer.layout, peer.num_blocks, int(peer.address["num_slots"]), peer.worker_id)
        self._peers[peer.worker_id] = seg
        self._copiers[peer.worker_id] = (
            KVBlockCopier(seg.cache_bytes, self._bytes) if copy_native_available(seg.cache_bytes, self._bytes) else None
        )
        self._summing[peer.worker_id] = (
            SummingCopier(seg.cache_bytes, self._bytes) if native_sums_available(seg.cache_bytes, self._bytes) else None
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

    # -- receiver --------------------------------------------------------------------------
    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> TransferHandle:
        dst, timeout_s = self._prepare_expect(transfer_id, dst_block_ids, timeout_s)
        seg = self._own
        if seg is None:
            raise ValueError(
                "this shm transport's cache was registered, not allocated in shared memory, so it cannot receive"
            )
        rec = self._new_record(transfer_id, Role.RECV, dst, timeout_s)
        if rec.status.is_terminal:
            return rec.handle()
        key = transfer_key(transfer_id)
        with seg.locked():
            slot = self._free_slot(seg, key)
            row = seg.slots[slot]
            row[[_HASH, _NBLOCKS, _REASON, _DEADLINE, _SENT_BLOCKS, _LANDED, _STATE]] = (
                ids_hash(dst),
                len(dst),
                0,
                int(rec.deadline * 1e9),
                _UNSEALED,
                0,
                _PENDING,
            )
            row[_KEY] = key  # last: senders look slots up by key
        # Sums the verifier thread took: blocks [0, summed[0]), kept current (a lander sums the rest).
        rec.extra.update(
            slot=slot, sums=np.empty((len(dst), 2), np.uint64), summed=np.zeros(1, np.int64), ids=array("q", dst)
        )
        self._follower.follow(rec)
        return rec.handle()

    def _free_slot(self, seg: _Segment, key: int) -> int:
        with self._lock:  # slots left terminal that no live local record owns may be reclaimed
            live = {
                r.extra.get("slot") for r in self._records.values() if r.role == Role.RECV and not r.status.is_terminal
            }
        return seg.free_slot(key, live)

    def _late_detail(self, rec: Record) -> str:
        seg = rec.extra.get("seg") if rec.role == Role.SEND else None
        return (
            ""
            if seg is None
            else (f"the receiver's slot {'is' if seg.find(rec.extra['key']) >= 0 else 'never was'} in {seg.path}")
        )

    def _refresh(self, rec: Record) -> None:
        if rec.role != Role.RECV or rec.status.is_terminal or "slot" not in rec.extra:
            return
        seg, slot = self._own, rec.extra["slot"]
        state = TransferStatus(int(seg.slots[slot, _STATE]))
        if state == TransferStatus.TRANSFERRING:
            self._set_transferring(rec)
        elif state.is_terminal:
            if state == TransferStatus.SUCCESS:
                self._land(rec, seg, slot)
            else:
                code = int(seg.slots[slot, _REASON])
                self._finish(rec, state, _REASONS.get(code, "") or state.name.lower(), _REASON_KINDS.get(code))
            with seg.locked():
                if seg.slots[slot, _KEY] == transfer_key(rec.transfer_id) and state == TransferStatus.SUCCESS:
                    seg.slots[slot, _KEY] = 0

    def _terminate(self, rec: Record, status: TransferStatus, error: str, reason: FailureReason | None = None) -> None:
        if rec.role != Role.RECV or "slot" not in rec.extra or self._own is None:
            super()._terminate(rec, status, error, reason)
            return
        self._cancel(rec)
        seg, slot = self._own, rec.extra["slot"]
        # Taking the segment lock waits for a sender's in-progress copy to end.
        with seg.locked():
            if seg.slots[slot, _KEY] == transfer_key(rec.transfer_id):
                state = TransferStatus(int(seg.slots[slot, _STATE]))
                if state == TransferStatus.SUCCESS:
                    self._land(rec, seg, slot)  # fully landed before the abort
                    return
                if not state.is_terminal:
                    seg.slots[slot, _STATE] = int(status)
                    seg.slots[slot, _REASON] = 3 if status == TransferStatus.ABORTED else 4
            self._finish(rec, status, error, reason)

    def _land(self, rec: Record, seg: _Segment, slot: int) -> None:
        """The sender reported SUCCESS: verify its manifest against the blocks in our cache: the
        sums the verifier thread took while the copy ran, and those of the rest, taken now. Any
        thread may land (the first verdict wins; all are the same); none waits for the verifier
        thread, which may not be getting a core right now."""
        if rec.status.is_terminal:
            return
        sent_key, sent_tag, sent_blocks = (int(v) for v in seg.slots[slot, _SENT_KEY : _SENT_BLOCKS + 1])
        manifest = sums = None
        if sent_blocks != _UNSEALED:
            n = max(0, min(sent_blocks, rec.num_blocks))
            seals = seg.seals[np.asarray(rec.block_ids[:n], dtype=np.int64)].astype("<u8").tobytes()
            manifest = Manifest(sent_key, sent_tag, sent_blocks, seals)
            done = int(rec.extra["summed"][0])
            sums = rec.extra["sums"][:done]
            if done < rec.num_blocks:
                sums = np.concatenate([sums, self._block_sums(rec.block_ids[done:])])
        verdict = self._verify(rec, manifest, sums)
        if verdict is None:
            self._finish(rec, TransferStatus.SUCCESS)
        else:
            self._finish(rec, TransferStatus.FAILED, verdict.message, verdict.reason)

    def _look(self, rec: Record) -> Progress:
        """The verifier thread's step for one receive (kvtransfer._follower): land it if its sender
        is done, else sum the blocks the sender counts as landed, natively following the copy to its
        end (one that has not moved for STALLED_S gets a look only). `summed` moves on after the sums."""
        self._refresh(rec)
        self._expire_if_due(rec)
        if rec.status != TransferStatus.TRANSFERRING:
            return Progress.ENDED if rec.status.is_terminal else Progress.WAITING
        extra, row, now = rec.extra, self._own.slots[rec.extra["slot"]], time.monotonic()
        done = upto = int(extra["summed"][0])
        if self._summer is not None:
            wait_s = FOLLOW_WAIT_S if now - extra.setdefault("moved_at", now) < STALLED_S else 0.0
            upto = self._summer.follow(
                extra["ids"],
                extra["sums"],
                extra["summed"],
                row[_LANDED : _LANDED + 1],
                row[_STATE : _STATE + 1],
                _TRANSFERRING,
                wait_s,
            )
        elif (landed := min(max(int(row[_LANDED]), 0), rec.num_blocks)) > done:  # the sender's word
            extra["sums"][done:landed] = self._block_sums(rec.block_ids[done:landed])
            extra["summed"][0] = upto = landed
        if upto <= done:
            return Progress.COPYING
        extra["moved_at"] = time.monotonic()
        return Progress.SUMMED

    # -- sender ----------------------------------------------------------------------------
    def send(
        self,
        peer_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float,
    ) -> TransferHandle:
        """If the receiver has already called expect(), the copy happens before this
        returns (the handle is then terminal); otherwise a worker thread does it once the
        receiver's slot appears."""
        self._require_cache()
        seg = self._peers.get(peer_id)
        if seg is None:
            raise ValueError(f"unknown peer {peer_id!r}: call connect() with its endpoint first")
        if self.checksums:  # the receiver's verifier thread gets ready while we prepare
            wake(self._wakers.get(peer_id))
        src, dst, timeout_s = self._prepare_send(len(seg.seals), src_block_ids, dst_block_ids, transfer_id, timeout_s)
        rec = self._new_record(transfer_id, Role.SEND, src, timeout_s)
        if rec.status.is_terminal:
            return rec.handle()
        # Everything the copy needs is worked out before the segment lock is taken.
        fault = self._planned_fault(transfer_id)
        rec.extra.update(
            seg=seg,
            copier=self._copiers[peer_id],
            key=transfer_key(transfer_id),
            waker=self._wakers.get(peer_id),
            nblocks=len(dst),
            dst_hash=ids_hash(dst),
            dst=dst,
            fault=fault,
            summing=self._summing[peer_id],
            not_before=rec.deadline + fault.stall_s if fault is not None and fault.kind == FaultKind.STALL else 0.0,
        )
        # Common case: the receiver reserved and expect()ed first. Copy right here: one
        # memcpy, no thread hand-off.
        if rec.extra["not_before"] or not self._try_send(rec):
            if not seg.owner_alive():  # an exited receiver never expects it: fail now, not at the deadline
                self._finish(rec, TransferStatus.FAILED, f"the receiver of {seg.path} has exited")
                return rec.handle()
            with self._lock:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._send_worker, daemon=True, name="kv-shm-send")
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
            jobs: list[Record | None] = []
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
        if extra["not_before"] and time.monotonic() < extra["not_before"]:
            return False  # injected stall: the data leaves after the deadline
        seg: _Segment = extra["seg"]
        key = extra["key"]
        slot = seg.find(key)
        if slot < 0:
            # The receiver's expect() normally precedes send(); until it comes, wait.
            if time.monotonic() > rec.deadline:
                self._finish(
                    rec,
                    TransferStatus.FAILED,
                    f"receiver never expected transfer {rec.transfer_id!r}",
                    FailureReason.DEADLINE,
                )
                return True
            return False
        with seg.locked(), rec.mem_lock:
            row = seg.slots[slot]
            slot_key, state, dst_hash, nblocks, reason, deadline = row[:_SENT_KEY].tolist()
            if slot_key != key:
                return False  # reclaimed meanwhile; look again
            if state != _PENDING:
                why = _REASONS.get(reason, "") or TransferStatus(state).name.lower()
                status = TransferStatus(state) if state in (_ABORTED, _FAILED) else TransferStatus.FAILED
                self._finish(rec, status, f"receiver side: {why}", _REASON_KINDS.get(reason))
                return True
            if time.monotonic_ns() > deadline:
                row[_STATE], row[_REASON] = _FAILED, 4
                self._finish(rec, TransferStatus.FAILED, f"receiver side: {_REASONS[4]}", FailureReason.DEADLINE)
                return True
            if dst_hash != extra["dst_hash"] or nblocks != extra["nblocks"]:
                row[_STATE], row[_REASON] = _FAILED, 1
                self._finish(
                    rec,
                    TransferStatus.FAILED,
                    f"transfer {rec.transfer_id!r}: {_REASONS[1]}",
                    FailureReason.IDS_MISMATCH,
                )
                return True
            if rec.status.is_terminal:  # aborted/expired on this side before the copy
                row[_STATE], row[_REASON] = _ABORTED, 2
                return True
            row[_STATE] = _TRANSFERRING
            # Only a holder of rec.mem_lock moves a send record on (abort and expiry take it
            # too), so no need for the transport lock here.
            rec.status = TransferStatus.TRANSFERRING
            fault: Fault | None = extra["fault"]
            dst, src = extra["dst"], rec.block_ids
            summing = extra["summing"]
            sums = None
            if fault is not None:
                sums = self._block_sums(src) if self.checksums else None
                if not faulty_copy(seg, row, fault, src, dst, self._bytes, self.checksums, extra["waker"]):
                    # The slot stays TRANSFERRING, as a dead process leaves it (its flock goes with it):
                    # the receiver runs into its deadline.
                    self._finish(
                        rec,
                        TransferStatus.FAILED,
                        "injected fault: sender killed mid-transfer",
                        FailureReason.SENDER_FAILED,
                    )
                    return True
            elif summing is not None and self.checksums:  # the common case: one native call copies and sums
                wake(extra["waker"])  # the receiver's verifier thread follows the chunks as they land
                sums = summing(array("q", dst), array("q", src), row[_LANDED : _LANDED + 1], self._chunk_blocks)
            elif summing is not None:  # checksums off: the same copy without the sums
                summing(array("q", dst), array("q", src), sums=False)
            else:
                sums = self._block_sums(src) if self.checksums else None
                self._copy(extra, seg, src, dst)
            if sums is None:
                row[_SENT_BLOCKS] = _UNSEALED
            else:
                manifest = faulty_manifest(fault, Manifest.of(sums, key, self._tag))
                seg.seals[np.asarray(dst[: manifest.nblocks], dtype=np.int64)] = manifest.seal_array()
                row[_SENT_KEY], row[_SENT_TAG], row[_SENT_BLOCKS] = manifest.key, manifest.tag, manifest.nblocks
            row[_STATE] = _SUCCESS
            self._finish(rec, TransferStatus.SUCCESS)
        return True

    def _copy(self, extra: dict, seg: _Segment, src: list[int], dst: list[int]) -> None:
        copier = extra["copier"]
        if copier is not None:
            copier(array("q", dst), array("q", src))
        elif self._rows is not None:  # native kernels off or unbuildable
            copy_runs(seg.rows, self._rows, coalesce(src, dst))
        else:  # a registered cache on another device
            copy_blocks(seg.cache_bytes, dst, self._bytes, src)

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
