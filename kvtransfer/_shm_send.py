"""The sending side of the shm transport (kvtransfer.shm has the protocol): `send()` copies our blocks
straight into the slots a receiver reserved in its segment, under the segment's lock, summing them
as it copies when checksums are on and sealing the slot with the manifest before SUCCESS. A send
that arrives before the receiver's `expect()` waits on one long-lived background thread."""

from __future__ import annotations

import queue
import threading
import time
from array import array
from collections.abc import Sequence

import numpy as np

from ._common import Record, coalesce, copy_blocks, copy_runs, ids_hash, transfer_key
from ._follower import wake
from ._segment import ABORTED as _ABORTED
from ._segment import FAILED as _FAILED
from ._segment import LANDED as _LANDED
from ._segment import PENDING as _PENDING
from ._segment import REASON as _REASON
from ._segment import REASON_KINDS as _REASON_KINDS
from ._segment import REASONS as _REASONS
from ._segment import SENT_BLOCKS as _SENT_BLOCKS
from ._segment import SENT_KEY as _SENT_KEY
from ._segment import SENT_TAG as _SENT_TAG
from ._segment import STATE as _STATE
from ._segment import SUCCESS as _SUCCESS
from ._segment import TRANSFERRING as _TRANSFERRING
from ._segment import UNSEALED as _UNSEALED
from ._segment import Segment as _Segment
from ._shm_core import ShmCore
from ._shm_faults import faulty_copy
from .base import TransferHandle, TransferSide, TransferStatus
from .integrity import FailureReason, Fault, FaultKind, Manifest, faulty_manifest


class ShmSender(ShmCore):
    """The sender's half of `kvtransfer.shm.ShmTransport`; the state it uses (the peers' segments,
    copiers and wake FIFOs, and the queue of sends waiting for their receiver) is ShmCore's."""

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
        rec = self._new_record(transfer_id, TransferSide.SEND, src, timeout_s)
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
            pending.extend(rec for rec in jobs if rec is not None)
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
            # close() aborts this send, which waits for rec.mem_lock, before it drops our cache.
            assert self._bytes is not None
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
            assert self._bytes is not None  # held by the caller, _try_send
            copy_blocks(seg.cache_bytes, dst, self._bytes, src)

    def _late_detail(self, rec: Record) -> str:
        seg = rec.extra.get("seg") if rec.role == TransferSide.SEND else None
        return (
            ""
            if seg is None
            else (f"the receiver's slot {'is' if seg.find(rec.extra['key']) >= 0 else 'never was'} in {seg.path}")
        )
