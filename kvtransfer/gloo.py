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

import time

from common.transports import Place

from ._gloo_recv import GlooReceiver
from ._gloo_send import GlooSender


class GlooTransport(GlooReceiver, GlooSender):
    """Both sides of the protocol above (the receiver's half in kvtransfer/_gloo_recv.py, the
    sender's in kvtransfer/_gloo_send.py, the state, the backend hooks NCCL overrides and the
    constructor in kvtransfer/_gloo_core.py); here: teardown."""

    kind = "gloo"

    @classmethod
    def for_place(cls, place: Place, checksums: bool = True) -> GlooTransport:
        """Bound to the node's address, so peers on other nodes reach it (nccl inherits this)."""
        return cls(host=place.host, checksums=checksums)

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
