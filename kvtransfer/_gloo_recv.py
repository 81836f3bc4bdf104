"""The receiving side of the point-to-point transport (kvtransfer.gloo has the protocol): the control
server's service thread that accepts pairs, one receive loop per pair that takes each announced
payload and unpacks it chunk by chunk into the reserved blocks (or parks it until `expect()`
comes), verifies it against the sender's manifest, and appends the outcome to the pair's verdict
stream."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from common.protocol import KVEndpoint, KVLayoutMismatch

from ._common import GRACE_S, Record, ids_hash, transfer_key
from ._control import ControlClient, ControlServer, StoreAdapter
from ._gloo_core import GlooCore
from ._pair import ConnRequest, InPair, PairGroup, Parked, Staging, XferMsg, as_timedelta, chunk_spans
from ._staged import staged_sums, take_manifest
from .base import TransferHandle, TransferSide, TransferStatus
from .integrity import FailureReason, Manifest, verify

# What stopped a receive: its terminal status and error.
Failure = tuple[TransferStatus, str | None]


class GlooReceiver(GlooCore):
    """The receiver's half of `kvtransfer.gloo.GlooTransport`; uses GlooCore's state, backend hooks
    (`_device`, `_make_group`, `_sync`, `_pack_chunk`, `_unpack_chunk`: overridden by NCCL) and
    helpers (`_client`, `_own_address`, `_spawn`)."""

    def endpoint(self) -> KVEndpoint:
        _, layout = self._require_cache()
        with self._lock:
            if self._server is None:
                self._server = ControlServer(self._host, self._port)
                self._service = self._spawn(self._serve, name=f"kv-{self.kind}-service")
        return KVEndpoint(self.kind, self._worker_id, layout, self._num_blocks, self._own_address())

    def _serve(self) -> None:
        try:
            store = self._client(self._own_address())
        except Exception:  # closed right after endpoint(): nothing to serve
            return
        i = 0
        while True:
            try:
                req = store.take(f"conn/{i}")
            except Exception:  # server closed: transport closing
                return
            i += 1
            assert isinstance(req, ConnRequest)
            try:
                assert self._layout is not None
                self._layout.check_compatible(req.layout)
            except KVLayoutMismatch as exc:
                store.set(f"conn/{req.pair}/reply", f"layout:{exc}")
                continue
            store.set(f"conn/{req.pair}/reply", "ok")
            self._spawn(self._serve_pair, req, name=f"kv-{self.kind}-recv-{req.pair}")

    def _serve_pair(self, req: ConnRequest) -> None:
        address = self._own_address()
        try:
            store = self._client(address)
            inp = InPair(req.pair, self._client(address))
            group = self._make_group(
                StoreAdapter(self._client(address), f"{req.pair}/pg", self._connect_timeout.total_seconds()), 1
            )
        except Exception:
            return  # the sender's connect() reports the failure
        with self._lock:
            self._in[req.pair] = inp
        staging = Staging(self._device())
        try:
            while True:
                msg = store.take(f"{req.pair}/msg/{inp.next_seq}")
                if msg.kind == "close":
                    break
                seq = inp.next_seq
                inp.next_seq += 1
                if not self._receive(inp, group, staging, msg, seq, store):
                    break
        except Exception:
            pass  # server closed: transport closing
        store.close()
        inp.reply_store.close()
        with self._lock:
            self._in.pop(req.pair, None)
            parked = list(inp.parked.values())
            inp.parked.clear()
        for p in parked:
            p.timer.cancel()

    def _receive(
        self, inp: InPair, group: PairGroup, staging: Staging, msg: XferMsg, seq: int, store: ControlClient
    ) -> bool:
        """Receive one announced payload, unpacking each chunk as it lands (or park the
        whole payload if expect() has not come yet). False if the pair broke."""
        deadline = time.monotonic() + msg.remaining_s
        rec = self._get(msg.transfer_id, TransferSide.RECV)
        live = rec if rec is not None and not rec.status.is_terminal else None  # the receive it lands in
        # A payload that may have to wait for its expect() gets its own buffer.
        buf = (
            staging.get(msg.nbytes)
            if live is not None
            else torch.empty(msg.nbytes, dtype=torch.uint8, device=self._device())
        )
        chunks = chunk_spans(msg.nblocks, msg.chunk_blocks)
        block_bytes = msg.nbytes // msg.nblocks
        works = [group.recv([buf[a * block_bytes : (a + c) * block_bytes]], 0, i) for i, (a, c) in enumerate(chunks)]
        failure: Failure | None = None
        sums: list[np.ndarray] = []
        if live is not None:
            self._set_transferring(live)
            failure = self._check_ids(live, msg)
        try:
            for (a, c), work in zip(chunks, works):
                work.wait(as_timedelta(deadline - time.monotonic() + GRACE_S))
                if live is not None and failure is None:
                    self._sync()
                    if msg.sealed:
                        assert self._bytes is not None  # close() ends every receive before it drops the cache
                        sums.append(staged_sums(self._bytes, buf, a, c, block_bytes))
                    failure = self._unpack(live, buf, a, c)
        except Exception as exc:
            err = f"payload of {msg.transfer_id!r} not received, pair broken: {exc}"
            if rec is not None:
                self._finish(rec, TransferStatus.FAILED, err, FailureReason.SENDER_FAILED)
            self._verdict(inp, seq, TransferStatus.FAILED, err, FailureReason.SENDER_FAILED)
            return False
        manifest = take_manifest(store, f"{inp.pair}/manifest/{seq}", deadline + GRACE_S) if msg.sealed else None
        if live is not None:
            if failure is None and msg.sealed:
                failure = self._check_manifest(live, msg, manifest, np.concatenate(sums))
            if failure is None:
                self._finish(live, TransferStatus.SUCCESS)
            status, error = failure or (TransferStatus.SUCCESS, None)
            self._verdict(inp, seq, status, error, live.reason)
            return True
        with self._cond:
            rec = self._get(msg.transfer_id, TransferSide.RECV)
            if rec is None:
                timer = threading.Timer(
                    max(0.0, deadline - time.monotonic()), self._expire_parked, (inp, msg.transfer_id)
                )
                timer.daemon = True
                inp.parked[msg.transfer_id] = Parked(msg, seq, buf, timer, manifest)
                timer.start()
                return True
        self._settle(inp, rec, msg, seq, buf, manifest)
        return True

    def _check_manifest(self, rec: Record, msg: XferMsg, manifest: Manifest | None, sums: np.ndarray) -> Failure | None:
        if manifest is None:
            verdict_reason, message = FailureReason.INCOMPLETE, "the sender's manifest never arrived"
        else:
            verdict = verify(manifest, transfer_key(rec.transfer_id), self._tag, rec.num_blocks, sums)
            if verdict is None:
                return None
            verdict_reason, message = verdict.reason, verdict.message
        message = f"transfer {msg.transfer_id!r}: {message}"
        self._finish(rec, TransferStatus.FAILED, message, verdict_reason)
        return rec.status, rec.error

    def _check_ids(self, rec: Record, msg: XferMsg) -> Failure | None:
        if msg.nbytes != rec.nbytes:
            error = (
                f"transfer {msg.transfer_id!r}: {msg.nbytes} bytes announced for {msg.nblocks} blocks, "
                f"this layout needs {rec.nbytes}"
            )
            self._finish(rec, TransferStatus.FAILED, error, FailureReason.FOREIGN_LAYOUT)
            return TransferStatus.FAILED, error
        if ids_hash(rec.block_ids) == msg.dst_hash and len(rec.block_ids) == msg.nblocks:
            return None
        error = f"transfer {msg.transfer_id!r}: sender's dst_block_ids differ from the receiver's {rec.block_ids}"
        self._finish(rec, TransferStatus.FAILED, error, FailureReason.IDS_MISMATCH)
        return TransferStatus.FAILED, error

    def _unpack(self, rec: Record, buf: torch.Tensor, start: int, count: int) -> Failure | None:
        """Unpack blocks [start, start + count) of the payload unless the transfer was
        aborted or expired; returns the terminal (status, error) that stopped it."""
        self._expire_if_due(rec)
        assert self._bytes is not None
        with rec.mem_lock:
            if rec.status.is_terminal:
                return rec.status, rec.error
            block_bytes = rec.nbytes // rec.num_blocks
            # The sender packs each chunk separately: [L, 2, count, ...] per chunk.
            self._unpack_chunk(
                rec.block_ids[start : start + count], buf[start * block_bytes : (start + count) * block_bytes]
            )
            self._sync()
        return None

    def _settle(
        self, inp: InPair, rec: Record, msg: XferMsg, seq: int, buf: torch.Tensor, manifest: Manifest | None
    ) -> None:
        """Verify and unpack a fully received (parked) payload."""
        failure: Failure | None = None if rec.status.is_terminal else self._check_ids(rec, msg)
        if rec.status.is_terminal:
            failure = rec.status, rec.error
        spans = chunk_spans(msg.nblocks, msg.chunk_blocks)
        if failure is None and msg.sealed:
            assert self._bytes is not None  # close() ends every receive before it drops the cache
            block_bytes = msg.nbytes // msg.nblocks
            sums = np.concatenate([staged_sums(self._bytes, buf, a, c, block_bytes) for a, c in spans])
            failure = self._check_manifest(rec, msg, manifest, sums)
        for a, c in spans:
            if failure is not None:
                break
            failure = self._unpack(rec, buf, a, c)
        if failure is None:
            self._finish(rec, TransferStatus.SUCCESS)
        status, error = failure or (TransferStatus.SUCCESS, None)
        self._verdict(inp, seq, status, error, rec.reason)

    def _expire_parked(self, inp: InPair, transfer_id: str) -> None:
        with self._cond:
            parked = inp.parked.pop(transfer_id, None)
        if parked is not None:
            self._verdict(
                inp,
                parked.seq,
                TransferStatus.FAILED,
                f"receiver never expected transfer {transfer_id!r}",
                FailureReason.DEADLINE,
            )

    def _verdict(
        self, inp: InPair, seq: int, status: TransferStatus, error: str | None, reason: str | None = None
    ) -> None:
        reason = None if reason is None else FailureReason(reason).value
        try:
            with inp.reply_lock:
                inp.reply_store.append(f"{inp.pair}/verdict", (seq, int(status), error, reason))
        except Exception:
            pass  # sender gone: its records run into their deadlines

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> TransferHandle:
        dst, timeout_s = self._prepare_expect(transfer_id, dst_block_ids, timeout_s)
        with self._cond:
            rec = self._new_record(transfer_id, TransferSide.RECV, dst, timeout_s)
            parked = None
            for inp in self._in.values():
                parked = inp.parked.pop(transfer_id, None)
                if parked is not None:
                    break
        if parked is not None:
            parked.timer.cancel()
            self._set_transferring(rec)
            self._settle(inp, rec, parked.msg, parked.seq, parked.buf, parked.manifest)
        return rec.handle()
