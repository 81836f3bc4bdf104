"""The receiving side of the shm transport (kvtransfer.shm has the protocol): `expect()` reserves a
slot in our segment's table, and the receiver verifies what a sender copied into our cache, following
the copy from the verifier thread (kvtransfer._follower) and landing it once the sender reports
SUCCESS; a receiver's abort marks the slot under the segment's lock."""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

import numpy as np

from ._common import Record, ids_hash, transfer_key
from ._follower import FOLLOW_WAIT_S, STALLED_S, Progress
from ._segment import DEADLINE as _DEADLINE
from ._segment import HASH as _HASH
from ._segment import KEY as _KEY
from ._segment import LANDED as _LANDED
from ._segment import NBLOCKS as _NBLOCKS
from ._segment import PENDING as _PENDING
from ._segment import REASON as _REASON
from ._segment import REASON_KINDS as _REASON_KINDS
from ._segment import REASONS as _REASONS
from ._segment import SENT_BLOCKS as _SENT_BLOCKS
from ._segment import SENT_KEY as _SENT_KEY
from ._segment import STATE as _STATE
from ._segment import TRANSFERRING as _TRANSFERRING
from ._segment import UNSEALED as _UNSEALED
from ._segment import Segment as _Segment
from ._shm_core import ShmCore
from .base import TransferHandle, TransferSide, TransferStatus
from .integrity import FailureReason, Manifest


class ShmReceiver(ShmCore):
    """The receiver's half of `kvtransfer.shm.ShmTransport`; the state it uses (our segment `_own`
    and the verifier thread `_follower`) is ShmCore's."""

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> TransferHandle:
        dst, timeout_s = self._prepare_expect(transfer_id, dst_block_ids, timeout_s)
        seg = self._own
        if seg is None:
            raise ValueError(
                "this shm transport's cache was registered, not allocated in shared memory, so it cannot receive"
            )
        rec = self._new_record(transfer_id, TransferSide.RECV, dst, timeout_s)
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
        assert self._follower is not None  # made with our segment (ShmTransport.allocate_cache)
        self._follower.follow(rec)
        return rec.handle()

    def _free_slot(self, seg: _Segment, key: int) -> int:
        with self._lock:  # slots left terminal that no live local record owns may be reclaimed
            live = {
                r.extra.get("slot")
                for r in self._records.values()
                if r.role == TransferSide.RECV and not r.status.is_terminal
            }
        return seg.free_slot(key, live)

    def _refresh(self, rec: Record) -> None:
        if rec.role != TransferSide.RECV or rec.status.is_terminal or "slot" not in rec.extra:
            return
        seg, slot = self._own, rec.extra["slot"]
        assert seg is not None  # a receive with a slot is in our segment, dropped only once every receive ended
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
        if rec.role != TransferSide.RECV or "slot" not in rec.extra or self._own is None:
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
        # Our segment outlives the receives followed in it (gone only once closed(): the follower then ends).
        assert self._own is not None
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
