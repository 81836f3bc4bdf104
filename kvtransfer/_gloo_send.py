"""The sending side of the point-to-point transport (kvtransfer.gloo has the protocol): `connect()`'s
handshake and the pair's process group, `send()` queueing onto the pair's send loop, which packs
each transfer's blocks into staging chunk by chunk, announces it in the store, sends the chunks and
the manifest, and a watcher thread that turns the receiver's verdicts into the sender's results."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import numpy as np

from common.protocol import KVEndpoint, KVLayoutMismatch

from ._common import GRACE_S, ids_hash, transfer_key
from ._control import ControlClient, StoreAdapter
from ._gloo_core import GlooCore
from ._pair import ConnRequest, OutPair, Staging, XferMsg, as_timedelta, chunk_spans
from ._staged import spoil_staged, staged_sums
from .base import KVTransferError, TransferHandle, TransferSide, TransferStatus
from .integrity import FailureReason, FaultKind, Manifest, faulty_manifest


class GlooSender(GlooCore):
    """The sender's half of `kvtransfer.gloo.GlooTransport`; uses GlooCore's state, backend hooks
    (`_device`, `_make_group`, `_sync`, `_pack_chunk`, `_unpack_chunk`: overridden by NCCL) and
    helpers (`_client`, `_own_address`, `_spawn`)."""

    def connect(self, peer: KVEndpoint) -> str:
        _, layout = self._require_cache()
        if peer.kind != self.kind:
            raise ValueError(f"cannot connect a {self.kind} transport to a {peer.kind} endpoint")
        layout.check_compatible(peer.layout)
        with self._lock:
            out = self._out.get(peer.worker_id)
            if out is not None and out.broken is None:
                return peer.worker_id
        if out is not None:  # a broken pair: stop its threads before a new pair replaces it
            out.jobs.put(None)
            for t in out.threads:
                t.join(timeout=2.0)
        try:
            store = self._client(peer.address)
        except Exception as exc:
            raise KVTransferError(
                f"cannot reach {peer.kind} peer {peer.worker_id} at "
                f"{peer.address['host']}:{peer.address['port']}: "
                f"{exc}"
            ) from None
        pair = f"{self._worker_id}-{uuid.uuid4().hex[:8]}"
        assert self._layout is not None
        store.append("conn", ConnRequest(pair, self._worker_id, self._layout, self._num_blocks))
        try:
            reply = store.take(f"conn/{pair}/reply", self._connect_timeout.total_seconds())
        except Exception:
            raise KVTransferError(
                f"{peer.kind} peer {peer.worker_id} did not answer the handshake within {self._connect_timeout}"
            ) from None
        if reply.startswith("layout:"):
            raise KVLayoutMismatch(f"peer refused: {reply[7:]}")
        assert reply == "ok", reply
        group = self._make_group(
            StoreAdapter(self._client(peer.address), f"{pair}/pg", self._connect_timeout.total_seconds()), 0
        )
        out = OutPair(peer.worker_id, pair, store, group, peer.num_blocks)
        with self._lock:
            self._out[peer.worker_id] = out
        out.threads = [
            self._spawn(self._send_loop, out, name=f"kv-{self.kind}-send-{pair}"),
            self._spawn(self._watch_verdicts, out, self._client(peer.address), name=f"kv-{self.kind}-verdicts-{pair}"),
        ]
        return peer.worker_id

    def send(
        self,
        peer_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float,
    ) -> TransferHandle:
        self._require_cache()
        with self._lock:
            out = self._out.get(peer_id)
        if out is None:
            raise ValueError(f"unknown peer {peer_id!r}: call connect() with its endpoint first")
        if out.broken is not None:
            raise KVTransferError(f"pair with {peer_id} is broken ({out.broken}); reconnect")
        src, dst, timeout_s = self._prepare_send(
            out.peer_num_blocks, src_block_ids, dst_block_ids, transfer_id, timeout_s
        )
        rec = self._new_record(transfer_id, TransferSide.SEND, src, timeout_s)
        rec.extra["dst"] = dst
        if not rec.status.is_terminal:
            out.jobs.put(rec)
        return rec.handle()

    def _send_loop(self, out: OutPair) -> None:
        staging = Staging(self._device())
        seq = 0
        while True:
            rec = out.jobs.get()
            if rec is None:
                try:  # the receiver drops the pair; the verdict watcher exits
                    out.store.set(f"{out.pair}/msg/{seq}", XferMsg("close"))
                    out.store.append(f"{out.pair}/verdict", "close")
                except Exception:
                    pass
                out.store.close()
                return
            if out.broken is not None:
                self._finish(rec, TransferStatus.FAILED, f"pair broken: {out.broken}")
                continue
            dst = rec.extra["dst"]
            chunk_blocks = max(1, self._chunk_bytes // (rec.nbytes // rec.num_blocks))
            fault = self._planned_fault(rec.transfer_id)
            sealed = self.checksums
            try:
                # Packing reads the source blocks: under mem_lock, so an abort on this side
                # waits until they have been copied out (the sends then proceed from staging).
                with rec.mem_lock:
                    if rec.status.is_terminal:
                        continue  # aborted or expired before anything was announced
                    self._set_transferring(rec)
                    # close() aborts rec, which waits for mem_lock, before it drops the cache; the group
                    # goes only with the pair broken, checked above.
                    cache_bytes, group = self._bytes, out.group
                    assert cache_bytes is not None and group is not None
                    with self._lock:
                        out.in_flight[seq] = rec
                    out.store.set(
                        f"{out.pair}/msg/{seq}",
                        XferMsg(
                            "xfer",
                            rec.transfer_id,
                            len(dst),
                            rec.nbytes,
                            ids_hash(dst),
                            rec.deadline - time.monotonic(),
                            chunk_blocks,
                            sealed,
                        ),
                    )
                    buf = staging.get(rec.nbytes)
                    block_bytes = rec.nbytes // rec.num_blocks
                    spans = chunk_spans(len(dst), chunk_blocks)
                    works, sums = [], []
                    for i, (a, c) in enumerate(spans):
                        region = buf[a * block_bytes : (a + c) * block_bytes]
                        self._pack_chunk(rec.block_ids[a : a + c], region)
                        self._sync()
                        if sealed:
                            sums.append(staged_sums(cache_bytes, buf, a, c, block_bytes))
                        if fault is None:
                            works.append(group.send([region], 1, i))
                    manifest = (
                        Manifest.of(np.concatenate(sums), transfer_key(rec.transfer_id), self._tag) if sealed else None
                    )
                if fault is not None and fault.kind == FaultKind.KILL:  # dies after the announcement: as a
                    out.broken, out.group = "injected fault: sender killed mid-transfer", None  # dead process's,
                    with self._lock:  # its sockets close and the receiver sees the pair break
                        out.in_flight.pop(seq, None)
                    self._finish(rec, TransferStatus.FAILED, out.broken, FailureReason.SENDER_FAILED)
                    continue
                if fault is not None:
                    manifest = faulty_manifest(fault, manifest) if manifest is not None else None
                    spoil_staged(cache_bytes, fault, buf, spans, block_bytes, rec.deadline)
                if manifest is not None:
                    out.store.set(f"{out.pair}/manifest/{seq}", manifest)
                if fault is not None:
                    works = [
                        group.send([buf[a * block_bytes : (a + c) * block_bytes]], 1, i)
                        for i, (a, c) in enumerate(spans)
                    ]
                for work in works:
                    work.wait(as_timedelta(rec.deadline - time.monotonic() + GRACE_S))
            except Exception as exc:
                out.broken = f"{type(exc).__name__}: {exc}"
                self._finish(rec, TransferStatus.FAILED, f"send failed, pair broken: {exc}")
            seq += 1

    def _watch_verdicts(self, out: OutPair, store: ControlClient) -> None:
        n = 0
        while True:
            try:
                verdict = store.take(f"{out.pair}/verdict/{n}")
            except Exception:
                verdict = "close"
            n += 1
            if verdict == "close":
                store.close()
                return
            seq, status, error, reason = verdict
            with self._lock:
                rec = out.in_flight.pop(seq, None)
            if rec is not None:
                status = TransferStatus(status)
                self._finish(
                    rec, status, None if status == TransferStatus.SUCCESS else f"receiver side: {error}", reason
                )
