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

import torch
import torch.distributed as dist

from common.transports import Place

from ._common import pack_blocks, unpack_blocks
from ._control import ControlClient, ControlServer
from ._gloo_recv import GlooReceiver
from ._gloo_send import GlooSender
from ._pair import CHUNK_BYTES, InPair, OutPair, as_timedelta
from .integrity import FaultPlan


class GlooTransport(GlooReceiver, GlooSender):
    """Both sides of the protocol above (the receiver's half in kvtransfer/_gloo_recv.py, the
    sender's in kvtransfer/_gloo_send.py); here: the state, the backend hooks NCCL overrides, and
    teardown."""

    kind = "gloo"

    @classmethod
    def for_place(cls, place: Place, checksums: bool = True) -> GlooTransport:
        """Bound to the node's address, so peers on other nodes reach it (nccl inherits this)."""
        return cls(host=place.host, checksums=checksums)

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
