"""In-process backend: both caches live in one process (engine tests, single-process serving).

It is also the fake backend for the serving layer's failure tests: `fault="drop"` never
delivers (the transfer runs into its deadline), `fault="delay"` delivers after `fault_delay_s`,
`fault="fail"` fails at once; `fault="delay:SECONDS"` sets the delay too. Per-transfer faults
of the data itself (bit flips, lost or reordered blocks, a sender dying mid-copy...) come as a
`kvtransfer.integrity.FaultPlan`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

from common.protocol import KVEndpoint

from ._common import Record, TransportCore, block_rows, copy_blocks, ids_hash, transfer_key
from .base import TransferHandle, TransferSide, TransferStatus
from .integrity import (
    FailureReason,
    FaultKind,
    FaultPlan,
    Manifest,
    clamp_block,
    faulty_manifest,
    faulty_pairs,
    flip_bit,
)

FAULTS = ("drop", "delay", "fail")


def parse_fault(spec: str | None, delay_s: float) -> tuple[str | None, float]:
    if not spec:
        return None, delay_s
    name, _, arg = spec.partition(":")
    if name not in FAULTS:
        raise ValueError(f"unknown KV fault {spec!r}; expected one of {FAULTS} (delay:SECONDS)")
    if arg:
        try:
            delay_s = float(arg)
        except ValueError:
            raise ValueError(f"bad delay in KV fault {spec!r}") from None
    return name, delay_s


class InProcessTransport(TransportCore):
    kind = "inprocess"

    def __init__(
        self,
        fault: str | None = None,
        fault_delay_s: float = 0.5,
        checksums: bool = True,
        fault_plan: FaultPlan | None = None,
    ) -> None:
        super().__init__(checksums, fault_plan)
        self._worker_id = f"inproc-{uuid.uuid4().hex[:12]}"
        self._fault, self._fault_delay_s = parse_fault(fault, fault_delay_s)
        self._peers: dict[str, InProcessTransport] = {}

    def __reduce__(self):
        raise TypeError(
            "an in-process KV endpoint only works inside its own process; use the shm or gloo backend between processes"
        )

    def endpoint(self) -> KVEndpoint:
        _, layout = self._require_cache()
        return KVEndpoint(self.kind, self._worker_id, layout, self._num_blocks, {"transport": self})

    def connect(self, peer: KVEndpoint) -> str:
        _, layout = self._require_cache()
        if peer.kind != self.kind:
            raise ValueError(f"cannot connect a {self.kind} transport to a {peer.kind} endpoint")
        layout.check_compatible(peer.layout)
        transport = peer.address.get("transport")
        if not isinstance(transport, InProcessTransport):
            raise ValueError(f"peer {peer.worker_id}'s endpoint holds no in-process transport")
        self._peers[peer.worker_id] = transport
        return peer.worker_id

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> TransferHandle:
        dst, timeout_s = self._prepare_expect(transfer_id, dst_block_ids, timeout_s)
        return self._new_record(transfer_id, TransferSide.RECV, dst, timeout_s).handle()

    def send(
        self,
        peer_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float,
    ) -> TransferHandle:
        self._require_cache()
        peer: InProcessTransport | None = self._peers.get(peer_id)
        if peer is None:
            raise ValueError(f"unknown peer {peer_id!r}: call connect() with its endpoint first")
        src, dst, timeout_s = self._prepare_send(peer._num_blocks, src_block_ids, dst_block_ids, transfer_id, timeout_s)
        rec = self._new_record(transfer_id, TransferSide.SEND, src, timeout_s)
        rec.extra["dst"] = dst
        if not rec.status.is_terminal:
            threading.Thread(
                target=self._run_send, args=(rec, peer), daemon=True, name=f"kv-inproc-send-{transfer_id}"
            ).start()
        return rec.handle()

    def _run_send(self, rec: Record, peer: InProcessTransport) -> None:
        if self._fault == "drop":
            return  # never delivered: both sides run into their deadlines
        if self._fault == "fail":
            self._finish(rec, TransferStatus.FAILED, "injected fault: transfer failed")
            return
        if self._fault == "delay":
            with self._cond:
                if self._cond.wait_for(lambda: rec.cancelled, timeout=self._fault_delay_s):
                    return
        fault = self._planned_fault(rec.transfer_id)
        if fault is not None and fault.kind == FaultKind.STALL:
            with self._cond:  # the data leaves only after the deadline
                if self._cond.wait_for(
                    lambda: rec.cancelled, timeout=max(0.0, rec.deadline - time.monotonic()) + fault.stall_s
                ):
                    return
        dst = rec.extra["dst"]
        with peer._cond:
            peer._cond.wait_for(
                lambda: peer._get(rec.transfer_id, TransferSide.RECV) is not None or rec.cancelled or peer._closed,
                timeout=max(0.0, rec.deadline - time.monotonic()),
            )
            target = peer._get(rec.transfer_id, TransferSide.RECV)
        if rec.cancelled:
            return
        if target is None:
            self._finish(
                rec,
                TransferStatus.FAILED,
                f"receiver never expected transfer {rec.transfer_id!r}",
                FailureReason.DEADLINE,
            )
            return
        if ids_hash(target.block_ids) != ids_hash(dst):
            msg = (
                f"transfer {rec.transfer_id!r}: sender's dst_block_ids {dst} differ from the "
                f"receiver's {target.block_ids}"
            )
            peer._finish(target, TransferStatus.FAILED, msg, FailureReason.IDS_MISMATCH)
            self._finish(rec, TransferStatus.FAILED, msg, FailureReason.IDS_MISMATCH)
            return
        peer._expire_if_due(target)
        # Lock order sender -> receiver; abort/expiry take only one of the two.
        with rec.mem_lock, target.mem_lock:
            if target.status.is_terminal:
                reason = None if target.reason is None else FailureReason(target.reason)
                self._finish(rec, target.status, f"receiver side: {target.error}", reason)
                return
            if rec.status.is_terminal:
                return
            self._set_transferring(rec)
            peer._set_transferring(target)
            src = rec.block_ids
            sums = self._block_sums(src) if self.checksums else None
            wrote_src, wrote_dst = faulty_pairs(fault, src, dst)
            # Both records are live, held under their mem_locks: close() ends them before it drops a cache.
            assert peer._bytes is not None and self._bytes is not None
            copy_blocks(peer._bytes, wrote_dst, self._bytes, wrote_src)
            if fault is not None and fault.kind == FaultKind.FLIP:
                flip_bit(block_rows(peer._bytes), dst[clamp_block(fault, len(dst))], fault.bit)
            if fault is not None and fault.kind == FaultKind.KILL:
                # Dead mid-copy: the receiver never hears of it again and runs into its deadline.
                self._finish(
                    rec,
                    TransferStatus.FAILED,
                    "injected fault: sender killed mid-transfer",
                    FailureReason.SENDER_FAILED,
                )
                return
            manifest = (
                None
                if sums is None
                else faulty_manifest(fault, Manifest.of(sums, transfer_key(rec.transfer_id), self._tag))
            )
            verdict = peer._verify(target, manifest)
            if verdict is not None:
                peer._finish(target, TransferStatus.FAILED, verdict.message, verdict.reason)
                self._finish(rec, TransferStatus.FAILED, f"receiver side: {verdict.message}", verdict.reason)
                return
            peer._finish(target, TransferStatus.SUCCESS)
            self._finish(rec, TransferStatus.SUCCESS)

    def close(self) -> None:
        if self._closed:
            return
        self._abort_all(f"{self.kind} transport closed")
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._peers.clear()
