"""Point-to-point transport over torch.distributed process groups: gloo (CPU), and the
protocol the NCCL transport (`nccl.py`, GPU) inherits.

Every receiver hosts a small control server (`_control.py`: a key-value store over Python
sockets with a random auth key); its address is the endpoint. A sender's `connect()` posts a
connection request (its layout) there; the receiver's service thread checks the layout,
replies, and both sides build a two-rank process group for this pair only (sender rank 0,
receiver rank 1), so pools of many workers pair up freely without a global world.

Per transfer, over the pair (payloads in send order):
  sender:   pack src blocks -> one contiguous buffer; announce {id, bytes, fingerprint of the
            dst ids, remaining time} as message `seq` in the store; send the buffer.
  receiver: receive it; if `expect()` was called, unpack into the reserved ids (unless the
            transfer was aborted or expired meanwhile); otherwise park the payload until
            `expect()` arrives or the deadline passes, so one late request never blocks the
            pair. Each outcome is appended to the pair's verdict stream, which a watcher
            thread on the sender turns into the sender's result.
Integrity (kvtransfer.integrity, `_staged.py`): each chunk is summed as packed and as landed;
the manifest follows the last chunk in the store; the receiver verifies before SUCCESS.
Control messages ride on the store because a timed-out receive breaks a gloo pair: the data
path only waits for bytes already announced, bounded by the deadline plus a grace. The same
store is the rendezvous of each pair's process group. Messages, chunking and per-pair
state are in `_pair.py`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from common.protocol import KVEndpoint, KVLayoutMismatch

from ._common import GRACE_S, Record, TransportCore, ids_hash, pack_blocks, transfer_key, unpack_blocks
from ._control import ControlClient, ControlServer, StoreAdapter
from ._pair import (
    CHUNK_BYTES,
    ConnRequest,
    InPair,
    OutPair,
    Parked,
    Staging,
    XferMsg,
    as_timedelta,
    chunk_spans,
)
from ._staged import spoil_staged, staged_sums, take_manifest
from .base import KVTransferError, Role, TransferHandle, TransferStatus
from .integrity import FailureReason, FaultKind, FaultPlan, Manifest, faulty_manifest, verify


class GlooTransport(TransportCore):
    kind = "gloo"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 30.0,
        chunk_bytes: int = CHUNK_BYTES,
        checksums: bool = True,
        fault_plan: FaultPlan | None = None,
    ) -> None:
        """`host`: the address this worker's control server and pair sockets bind to and
        advertise; loopback by default, a node IP for multi-node deployments. `chunk_bytes`:
        payload chunk size for pipelining (rounded to whole blocks)."""
        super().__init__(checksums, fault_plan)
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self._chunk_bytes = chunk_bytes
        self._host = host
        self._port = port
        self._connect_timeout = as_timedelta(connect_timeout_s)
        self._worker_id = f"{self.kind}-{uuid.uuid4().hex[:12]}"
        self._server: ControlServer | None = None
        self._service: threading.Thread | None = None
        self._out: dict[str, OutPair] = {}
        self._in: dict[str, InPair] = {}
        self._threads: list[threading.Thread] = []

    # -- backend specifics (overridden by NCCL) -------------------------------------------
    def _device(self) -> torch.device:
        return torch.device("cpu")

    def _make_group(self, store: dist.Store, rank: int):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = as_timedelta(3600)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)

    def _sync(self) -> None:
        """Make device work issued so far visible (no-op on CPU)."""

    def _pack_chunk(self, ids: list[int], region: torch.Tensor) -> None:
        """Gather blocks `ids` into the flat byte buffer `region` as [L, 2, n, ...]."""
        pack_blocks(self._bytes, ids, region)

    def _unpack_chunk(self, ids: list[int], region: torch.Tensor) -> None:
        shape = (self._bytes.shape[0], 2, len(ids)) + tuple(self._bytes.shape[3:])
        unpack_blocks(self._bytes, ids, region.view(shape))

    # -- helpers ---------------------------------------------------------------------------
    def _client(self, address: dict) -> ControlClient:
        return ControlClient(
            (address["host"], int(address["port"])), address["authkey"], self._connect_timeout.total_seconds()
        )

    def _own_address(self) -> dict:
        assert self._server is not None
        host, port = self._server.address
        return {"host": host, "port": port, "authkey": self._server.authkey}

    def _spawn(self, target, *args, name: str) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True, name=name)
        with self._lock:
            self._threads.append(t)
        t.start()
        return t

    # -- receiver: connections ---------------------------------------------------------------
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

    def _receive(self, inp: InPair, group, staging: Staging, msg: XferMsg, seq: int, store: ControlClient) -> bool:
        """Receive one announced payload, unpacking each chunk as it lands (or park the
        whole payload if expect() has not come yet). False if the pair broke."""
        deadline = time.monotonic() + msg.remaining_s
        rec = self._get(msg.transfer_id, Role.RECV)
        live = rec is not None and not rec.status.is_terminal
        # A payload that may have to wait for its expect() gets its own buffer.
        buf = staging.get(msg.nbytes) if live else torch.empty(msg.nbytes, dtype=torch.uint8, device=self._device())
        chunks = chunk_spans(msg.nblocks, msg.chunk_blocks)
        block_bytes = msg.nbytes // msg.nblocks
        works = [group.recv([buf[a * block_bytes : (a + c) * block_bytes]], 0, i) for i, (a, c) in enumerate(chunks)]
        failure: tuple[TransferStatus, str | None] | None = None
        sums: list[np.ndarray] = []
        if live:
            self._set_transferring(rec)
            failure = self._check_ids(rec, msg)
        try:
            for (a, c), work in zip(chunks, works):
                work.wait(as_timedelta(deadline - time.monotonic() + GRACE_S))
                if live and failure is None:
                    self._sync()
                    if msg.sealed:
                        sums.append(staged_sums(self._bytes, buf, a, c, block_bytes))
                    failure = self._unpack(rec, buf, a, c)
        except Exception as exc:
            err = f"payload of {msg.transfer_id!r} not received, pair broken: {exc}"
            if rec is not None:
                self._finish(rec, TransferStatus.FAILED, err, FailureReason.SENDER_FAILED)
            self._verdict(inp, seq, TransferStatus.FAILED, err, FailureReason.SENDER_FAILED)
            return False
        manifest = take_manifest(store, f"{inp.pair}/manifest/{seq}", deadline + GRACE_S) if msg.sealed else None
        if live:
            if failure is None and msg.sealed:
                failure = self._check_manifest(rec, msg, manifest, np.concatenate(sums))
            if failure is None:
                self._finish(rec, TransferStatus.SUCCESS)
            status, error = failure or (TransferStatus.SUCCESS, None)
            self._verdict(inp, seq, status, error, rec.reason)
            return True
        with self._cond:
            rec = self._get(msg.transfer_id, Role.RECV)
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

    def _check_manifest(
        self, rec: Record, msg: XferMsg, manifest: Manifest | None, sums: np.ndarray
    ) -> tuple[TransferStatus, str] | None:
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

    def _check_ids(self, rec: Record, msg: XferMsg) -> tuple[TransferStatus, str] | None:
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

    def _unpack(
        self, rec: Record, buf: torch.Tensor, start: int, count: int
    ) -> tuple[TransferStatus, str | None] | None:
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
        failure = None if rec.status.is_terminal else self._check_ids(rec, msg)
        if rec.status.is_terminal:
            failure = rec.status, rec.error
        spans = chunk_spans(msg.nblocks, msg.chunk_blocks)
        if failure is None and msg.sealed:
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
            rec = self._new_record(transfer_id, Role.RECV, dst, timeout_s)
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

    # -- sender ----------------------------------------------------------------------------
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
        rec = self._new_record(transfer_id, Role.SEND, src, timeout_s)
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
                            sums.append(staged_sums(self._bytes, buf, a, c, block_bytes))
                        if fault is None:
                            works.append(out.group.send([region], 1, i))
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
                    spoil_staged(self._bytes, fault, buf, spans, block_bytes, rec.deadline)
                if manifest is not None:
                    out.store.set(f"{out.pair}/manifest/{seq}", manifest)
                if fault is not None:
                    works = [
                        out.group.send([buf[a * block_bytes : (a + c) * block_bytes]], 1, i)
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

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._abort_all(f"{self.kind} transport closed")
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            outs = list(self._out.values())
            self._out.clear()
        for out in outs:
            out.jobs.put(None)
        for out in outs:
            for t in out.threads:
                t.join(timeout=2.0)
        if self._server is not None:
            self._server.close()  # wakes the service thread and the receive loops
        deadline = time.monotonic() + 2.0
        for t in list(self._threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._cache = self._bytes = None
