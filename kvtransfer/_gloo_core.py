"""What both halves of the point-to-point transport (kvtransfer.gloo has the protocol) use: the
receiver's (kvtransfer/_gloo_recv.py) and the sender's (kvtransfer/_gloo_send.py). The state, the
backend hooks NCCL overrides (kvtransfer/nccl.py) and the helpers, in the class both halves derive
from."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from ._common import TransportCore, pack_blocks, unpack_blocks
from ._control import ControlClient, ControlServer
from ._pair import CHUNK_BYTES, InPair, OutPair, PairGroup, as_timedelta
from .integrity import FaultPlan


class GlooCore(TransportCore):
    """The transport's state and hooks; kvtransfer.gloo.GlooTransport adds teardown."""

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
        self._connect_timeout: timedelta = as_timedelta(connect_timeout_s)
        self._worker_id = f"{self.kind}-{uuid.uuid4().hex[:12]}"
        self._server: ControlServer | None = None
        self._service: threading.Thread | None = None
        self._out: dict[str, OutPair] = {}
        self._in: dict[str, InPair] = {}
        self._threads: list[threading.Thread] = []

    # -- backend specifics (overridden by NCCL) -------------------------------------------
    def _device(self) -> torch.device:
        return torch.device("cpu")

    def _make_group(self, store: dist.Store, rank: int) -> PairGroup:
        # torch's stubs know the gloo options only as `Options` (with `devices`); the class is `_Options`.
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from torch's stubs
        opts._timeout = as_timedelta(3600)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        return cast(PairGroup, dist.ProcessGroupGloo(store, rank, 2, opts))

    def _sync(self) -> None:
        """Make device work issued so far visible (no-op on CPU)."""

    def _pack_chunk(self, ids: list[int], region: torch.Tensor) -> None:
        """Gather blocks `ids` into the flat byte buffer `region` as [L, 2, n, ...]."""
        assert self._bytes is not None  # the caller holds a live transfer, so a cache
        pack_blocks(self._bytes, ids, region)

    def _unpack_chunk(self, ids: list[int], region: torch.Tensor) -> None:
        assert self._bytes is not None  # the caller holds a live transfer, so a cache
        shape = (self._bytes.shape[0], 2, len(ids)) + tuple(self._bytes.shape[3:])
        unpack_blocks(self._bytes, ids, region.view(shape))

    # -- helpers ---------------------------------------------------------------------------
    def _client(self, address: dict[str, Any]) -> ControlClient:
        return ControlClient(
            (address["host"], int(address["port"])), address["authkey"], self._connect_timeout.total_seconds()
        )

    def _own_address(self) -> dict[str, Any]:
        assert self._server is not None
        host, port = self._server.address
        return {"host": host, "port": port, "authkey": self._server.authkey}

    def _spawn(self, target: Callable[..., object], *args: object, name: str) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True, name=name)
        with self._lock:
            self._threads.append(t)
        t.start()
        return t
