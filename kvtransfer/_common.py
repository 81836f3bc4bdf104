"""Shared machinery for the backends: per-transfer records with deadlines, block-id checks,
coalescing of block runs, and byte-level pack/copy helpers."""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.protocol import KVLayout
from kernels.block_checksum import BlockSummer, block_sums
from kernels.block_checksum import native_available as native_sums_available
from kernels.block_copy import copy_kv_blocks_cpu, copy_native_available

from .base import (
    KVTransport,
    TransferHandle,
    TransferResult,
    TransferSide,
    TransferStatus,
    check_cache,
    torch_dtype,
)
from .integrity import FailureReason, Fault, FaultPlan, Manifest, Verdict, layout_tag, verify

# Terminal records kept for late poll()/wait() calls before the oldest are dropped.
MAX_FINISHED_RECORDS = 4096
# Extra time granted to a step whose peer is known to be alive and working (e.g. an
# in-flight payload) before it is declared stuck.
GRACE_S = 5.0


def transfer_key(transfer_id: str) -> int:
    """Stable non-zero 63-bit key for a transfer id (fits an int64 slot in shared memory)."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ((1 << 63) - 1)) or 1


def ids_hash(block_ids: Sequence[int]) -> int:
    """63-bit fingerprint of a destination id list; both sides compare it to catch a sender
    and receiver that disagree about where the blocks go."""
    # array("q") gives the same little-endian int64 bytes as numpy at half the cost.
    digest = hashlib.blake2b(array("q", block_ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def check_transfer_id(transfer_id: str) -> str:
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ValueError(f"transfer_id must be a non-empty str, got {transfer_id!r}")
    return transfer_id


def check_timeout(timeout_s: float) -> float:
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise ValueError(f"timeout_s must be a number of seconds, got {timeout_s!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s!r}")
    return value


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str, unique: bool) -> list[int]:
    # Conversion and the range and duplicate checks run in C (map/min/max/set): half the
    # time of a Python loop.
    try:
        out = list(map(int, ids))
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of ints, got {ids!r}") from None
    if out and (min(out) < 0 or max(out) >= num_blocks):
        bad = next(i for i in out if not 0 <= i < num_blocks)
        raise ValueError(f"{what} contains {bad}, outside the cache's 0..{num_blocks - 1}")
    if unique and len(set(out)) != len(out):
        raise ValueError(f"{what} contains duplicate block ids: {out}")
    return out


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both id lists are consecutive, so each run is
    one strided copy instead of one per block."""
    assert len(src) == len(dst), (len(src), len(dst))
    runs: list[tuple[int, int, int]] = []
    if not len(src):
        return runs
    s0, d0, n = src[0], dst[0], 0
    for s, d in zip(src, dst):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


def byte_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """Same memory as uint8 `[L, 2, N, bs, Hk, D * itemsize]`: moving bytes keeps every dtype
    (FP8 included) bit-exact and avoids ops that lack FP8 kernels."""
    return kv_cache.view(torch.uint8)


def block_rows(cache_bytes: torch.Tensor) -> np.ndarray:
    """numpy `[L * 2, N, bytes of one block in one layer's K or V]` view of a contiguous CPU
    byte cache (same memory). Slicing numpy is cheaper per run than slicing torch, and three
    dims slice faster than six; make it once per cache, not per transfer."""
    if cache_bytes.device.type != "cpu" or not cache_bytes.is_contiguous():
        raise ValueError("block_rows needs a contiguous CPU cache")
    shape = cache_bytes.shape
    return cache_bytes.numpy().reshape(shape[0] * shape[1], shape[2], -1)


def copy_runs(dst: np.ndarray, src: np.ndarray, runs: Sequence[tuple[int, int, int]]) -> None:
    """Copy (src_start, dst_start, count) block runs between two `block_rows()` views: the
    path when the native copy (kernels/csrc/kv_block_copy.cpp) is off or cannot be built.

    Of the Python-level ways, one numpy assignment per run is the fastest (numpy fancy
    indexing, torch index_select/index_copy_, ctypes.memmove per row and torch copy_ per run
    are all slower). It copies one piece at a time, though, so scattered blocks run slower
    than a contiguous copy; the native copy keeps several pieces in flight."""
    for s, d, n in runs:
        dst[:, d : d + n] = src[:, s : s + n]


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
    """Copy block bytes src[:, :, src_ids] -> dst[:, :, dst_ids] (byte views): the native
    copy on the CPU when it is built, else numpy or torch per run of consecutive ids."""
    if copy_native_available(dst, src):
        copy_kv_blocks_cpu(dst, dst_ids, src, src_ids)
        return
    runs = coalesce(src_ids, dst_ids)
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous():
        copy_runs(block_rows(dst), block_rows(src), runs)
        return
    for s, d, n in runs:
        dst[:, :, d : d + n].copy_(src[:, :, s : s + n])


def pack_blocks(src: torch.Tensor, ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Gather src[:, :, ids] into `out` (a flat uint8 buffer, at least n blocks); returns the
    packed `[L, 2, n, ...]` view of `out`."""
    shape = (src.shape[0], src.shape[1], len(ids)) + tuple(src.shape[3:])
    packed = out[: int(np.prod(shape))].view(shape)
    copy_blocks(packed, range(len(ids)), src, ids)
    return packed


def unpack_blocks(dst: torch.Tensor, ids: Sequence[int], packed: torch.Tensor) -> None:
    copy_blocks(dst, ids, packed, range(len(ids)))


@dataclass(eq=False, slots=True)
class Record:
    """Book-keeping of one transfer on one side."""

    transfer_id: str
    role: TransferSide
    num_blocks: int
    nbytes: int
    deadline: float
    t_start: float
    block_ids: list[int] = field(default_factory=list)
    status: TransferStatus = TransferStatus.PENDING
    error: str | None = None
    reason: str | None = None  # a FailureReason value once FAILED or ABORTED
    t_end: float | None = None
    # Held while this transfer reads or writes cache memory, so that expiry and abort wait
    # for an in-progress copy instead of racing it.
    mem_lock: threading.Lock = field(default_factory=threading.Lock)
    # Set (under the transport's condition, which is then notified) once abort or expiry
    # starts. A flag, and `done` an Event made only when someone has to sleep on it: most
    # shm transfers are terminal before anyone waits, and an Event costs a small transfer.
    cancelled: bool = False
    done: threading.Event | None = None
    extra: dict = field(default_factory=dict)

    def handle(self) -> TransferHandle:
        return TransferHandle(self.transfer_id, self.role, self.num_blocks, self.nbytes, self.deadline)

    def result(self) -> TransferResult:
        end = self.t_end if self.t_end is not None else time.monotonic()
        return TransferResult(
            self.transfer_id, self.role, self.status, self.nbytes, end - self.t_start, self.error, self.reason
        )


class TransportCore(KVTransport):
    """Record management, deadlines, poll/wait/abort; backends add the data path."""

    def __init__(self, checksums: bool = True, fault_plan: FaultPlan | None = None) -> None:
        """`checksums`: seal what this side sends (kvtransfer.integrity); a receiver verifies
        whatever arrives sealed. `fault_plan`: faults to inject into this side's sends (tests)."""
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._records: OrderedDict[tuple[TransferSide, str], Record] = OrderedDict()
        self._cache: torch.Tensor | None = None
        self._bytes: torch.Tensor | None = None
        self._layout: KVLayout | None = None
        self._num_blocks = 0
        self._closed = False
        self.checksums = bool(checksums)
        self._faults = FaultPlan()
        self._tag = 0
        self._summer: BlockSummer | None = None
        self.set_fault_plan(fault_plan)

    # -- integrity -----------------------------------------------------------------------
    def set_fault_plan(self, plan: FaultPlan | None) -> None:
        """Faults to inject into this side's sends from now on (None: none)."""
        if plan is not None and not isinstance(plan, FaultPlan):
            raise ValueError(f"fault_plan must be a kvtransfer.integrity.FaultPlan, got {type(plan).__name__}")
        self._faults = plan or FaultPlan()

    def _planned_fault(self, transfer_id: str) -> Fault | None:
        return self._faults.fault_for(transfer_id)

    def _block_sums(self, ids: Sequence[int]) -> np.ndarray:
        """(s1, s2) sums `[n, 2]` of blocks `ids` of this side's cache (kernels.block_checksum)."""
        if self._summer is not None:
            return self._summer(array("q", ids))
        assert self._bytes is not None
        return block_sums(self._bytes, torch.tensor(list(ids), dtype=torch.int64, device=self._bytes.device))

    def _verify(self, rec: Record, manifest: Manifest | None, sums: np.ndarray | None = None) -> Verdict | None:
        """Receiver: check the blocks of `rec`, landed in this cache, against `manifest`
        (None: the sender did not seal them; nothing to check). `sums`: the blocks' sums when
        taken already (kvtransfer.shm sums them while they land), else summed here."""
        if manifest is None:
            return None
        return verify(
            manifest,
            transfer_key(rec.transfer_id),
            self._tag,
            rec.num_blocks,
            self._block_sums(rec.block_ids) if sums is None else sums,
        )

    def pending_transfers(self) -> list[str]:
        """Ids of this side's transfers that are not terminal yet (tests check none leak)."""
        with self._lock:
            return [r.transfer_id for r in self._records.values() if not r.status.is_terminal]

    # -- cache -------------------------------------------------------------------------
    def register_cache(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        if self._cache is not None:
            raise ValueError(f"{self.kind} transport already has a registered cache")
        self._num_blocks = check_cache(layout, kv_cache)
        self._cache, self._bytes, self._layout = kv_cache, byte_view(kv_cache), layout
        self._tag = layout_tag(layout)
        self._summer = BlockSummer(self._bytes) if native_sums_available(self._bytes) else None

    def allocate_cache(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        self._check_num_blocks(num_blocks)
        cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch_dtype(layout))
        self.register_cache(cache, layout)
        return cache

    @staticmethod
    def _check_num_blocks(num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")

    def _require_cache(self) -> tuple[torch.Tensor, KVLayout]:
        if self._closed:
            raise ValueError(f"{self.kind} transport is closed")
        if self._bytes is None or self._layout is None:
            raise ValueError(f"{self.kind} transport has no cache: call allocate_cache() or register_cache() first")
        return self._bytes, self._layout

    # -- records -----------------------------------------------------------------------
    def _new_record(self, transfer_id: str, role: TransferSide, block_ids: list[int], timeout_s: float) -> Record:
        _, layout = self._require_cache()
        now = time.monotonic()
        rec = Record(
            transfer_id, role, len(block_ids), len(block_ids) * layout.block_bytes, now + timeout_s, now, block_ids
        )
        with self._cond:
            key = (role, transfer_id)
            old = self._records.get(key)
            if old is not None and not old.status.is_terminal:
                raise ValueError(f"transfer {transfer_id!r} is already in progress ({role.value})")
            self._records.pop(key, None)
            self._records[key] = rec
            if len(self._records) > MAX_FINISHED_RECORDS:
                for k in [k for k, r in self._records.items() if r.status.is_terminal]:
                    if len(self._records) <= MAX_FINISHED_RECORDS // 2:
                        break
                    del self._records[k]
            self._cond.notify_all()
        if not block_ids:
            # Nothing to move: both sides complete immediately without talking to the peer.
            self._finish(rec, TransferStatus.SUCCESS)
        return rec

    def _get(self, transfer_id: str, role: TransferSide) -> Record | None:
        with self._lock:
            return self._records.get((role, transfer_id))

    def _record(self, handle: TransferHandle) -> Record:
        rec = self._get(handle.transfer_id, handle.role)
        if rec is None:
            raise ValueError(
                f"unknown transfer {handle.transfer_id!r} ({handle.role.value}) on this {self.kind} transport"
            )
        return rec

    def handle_for(self, transfer_id: str, role: TransferSide) -> TransferHandle:
        rec = self._get(transfer_id, role)
        if rec is None:
            raise ValueError(f"unknown transfer {transfer_id!r} ({role.value})")
        return rec.handle()

    def _finish(
        self, rec: Record, status: TransferStatus, error: str | None = None, reason: FailureReason | None = None
    ) -> bool:
        """Move `rec` to a terminal status once; later attempts are ignored. A failure without
        a `reason` counts as the sender's (or the link's) failure, an abort as ABORTED."""
        assert status.is_terminal
        if status == TransferStatus.ABORTED:
            reason = reason or FailureReason.ABORTED
        elif status == TransferStatus.FAILED:
            reason = reason or FailureReason.SENDER_FAILED
        with self._cond:
            if rec.status.is_terminal:
                return False
            rec.status, rec.error, rec.t_end = status, error, time.monotonic()
            rec.reason = None if reason is None else FailureReason(reason).value
            if rec.done is not None:
                rec.done.set()
            self._cond.notify_all()
            return True

    def _set_transferring(self, rec: Record) -> None:
        with self._cond:
            if rec.status == TransferStatus.PENDING:
                rec.status = TransferStatus.TRANSFERRING

    def _terminate(self, rec: Record, status: TransferStatus, error: str, reason: FailureReason | None = None) -> None:
        """Fail/abort from outside the data path; waits for an in-progress memory copy."""
        self._cancel(rec)
        with rec.mem_lock:
            self._finish(rec, status, error, reason)

    def _cancel(self, rec: Record) -> None:
        with self._cond:
            rec.cancelled = True
            self._cond.notify_all()

    def _refresh(self, rec: Record) -> None:
        """Hook: pull status kept outside this process (shared memory) into `rec`."""

    def _late_detail(self, rec: Record) -> str:
        """Hook: what a transfer past its deadline was still waiting for (for its error)."""
        return ""

    def _expire_if_due(self, rec: Record) -> None:
        if not rec.status.is_terminal and time.monotonic() > rec.deadline:
            detail = self._late_detail(rec)
            self._terminate(
                rec,
                TransferStatus.FAILED,
                f"transfer {rec.transfer_id!r} ({rec.role.value}) exceeded its "
                f"deadline of {rec.deadline - rec.t_start:.3f}s{'; ' + detail if detail else ''}",
                FailureReason.DEADLINE,
            )

    # -- KVTransport -------------------------------------------------------------------
    def poll(self, handle: TransferHandle) -> TransferStatus:
        rec = self._record(handle)
        self._refresh(rec)
        self._expire_if_due(rec)
        return rec.status

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferResult:
        rec = self._record(handle)
        if rec.status.is_terminal:  # e.g. an shm send that copied inline: nothing to refresh
            return rec.result()
        give_up = None if timeout_s is None else time.monotonic() + max(0.0, float(timeout_s))
        slice_s = 0.0002
        while True:
            self._refresh(rec)
            self._expire_if_due(rec)
            if rec.status.is_terminal:
                return rec.result()
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return rec.result()
            until = rec.deadline if give_up is None else min(rec.deadline, give_up)
            # Short growing slices: some completions are only visible by polling (shared
            # memory written by another process); local completions set `done` at once.
            with self._cond:
                if rec.status.is_terminal:
                    continue
                if rec.done is None:
                    rec.done = threading.Event()
            rec.done.wait(max(0.0, min(until - now, slice_s)) + 1e-4)
            slice_s = min(slice_s * 2, 0.005)

    def abort(self, transfer_id: str) -> None:
        check_transfer_id(transfer_id)
        for role in (TransferSide.SEND, TransferSide.RECV):
            rec = self._get(transfer_id, role)
            if rec is not None and not rec.status.is_terminal:
                self._terminate(rec, TransferStatus.ABORTED, f"transfer {transfer_id!r} aborted ({role.value} side)")

    def _abort_all(self, reason: str) -> None:
        with self._lock:
            recs = [r for r in self._records.values() if not r.status.is_terminal]
        for rec in recs:
            self._terminate(rec, TransferStatus.ABORTED, reason)

    def _prepare_send(
        self,
        peer_num_blocks: int,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float,
    ) -> tuple[list[int], list[int], float]:
        check_transfer_id(transfer_id)
        timeout_s = check_timeout(timeout_s)
        src = check_block_ids(src_block_ids, self._num_blocks, "src_block_ids", unique=False)
        dst = check_block_ids(dst_block_ids, peer_num_blocks, "dst_block_ids", unique=True)
        if len(src) != len(dst):
            raise ValueError(f"src_block_ids has {len(src)} ids but dst_block_ids has {len(dst)}")
        return src, dst, timeout_s

    def _prepare_expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float
    ) -> tuple[list[int], float]:
        check_transfer_id(transfer_id)
        self._require_cache()
        timeout_s = check_timeout(timeout_s)
        dst = check_block_ids(dst_block_ids, self._num_blocks, "dst_block_ids", unique=True)
        return dst, timeout_s
