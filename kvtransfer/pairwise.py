"""One KV transport per pair of workers, chosen from where both workers run.

A worker does not know its peers when it starts, so it cannot pick one backend for all of
them. `PairwiseTransport` holds every backend a worker may need and picks one per peer at
`connect()`, from both workers' `Place` (Ray node id, node IP, device):

    same node, CPU       -> shm   (one copy into the peer's mapped cache)
    different nodes, CPU -> gloo  (rendezvous on the receiver's node IP)
    GPU, either way      -> nccl  (NCCL uses CUDA IPC / NVLink inside a node by itself)

A choice other than auto (`--transport shm|gloo|nccl`) forces that backend for every pair;
shm between workers on different nodes is refused at the handshake, naming both nodes.

Receiving side: one cache, allocated by the first backend (shm puts it in shared memory) and
registered with the others. The receiver's endpoint carries each backend's own endpoint plus
its place; `expect()` announces the transfer to every backend, since the receiver does not
know which peer will send. The first backend to finish decides: success or a failure reported
before the deadline (only a used backend fails early) ends the transfer, and the others'
expectations are aborted so no late byte lands. Sending side: `send()` goes through the
backend chosen for that peer, and the per-peer counters (`links()`) say which one carried
how many blocks.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.protocol import KVEndpoint, KVLayout
from common.transports import FIXED_CHOICES, PeerLink, Place, offered_kinds

from ._common import MAX_FINISHED_RECORDS, check_transfer_id
from .base import KVTransferError, KVTransport, TransferHandle, TransferResult, TransferSide, TransferStatus
from .integrity import FaultPlan
from .registry import transport_for_place

KIND = "pairwise"
LOCAL_PLACE = Place()  # the default place (Place is frozen, so one instance serves every transport)


def pair_kind(choice: str, sender: Place, receiver: Place) -> str:
    """The backend for one sender -> receiver pair; KVTransferError when none can serve it."""
    if sender.device != receiver.device:
        raise KVTransferError(
            f"cannot move KV between a {sender.device} cache ({sender.short()}) and a "
            f"{receiver.device} cache ({receiver.short()}): give both pools the same device"
        )
    same_node = sender.node_id == receiver.node_id
    if choice in FIXED_CHOICES:
        if choice == "shm" and not same_node:
            raise KVTransferError(
                f"transport shm works inside one node, but the sender is on {sender.short()} "
                f"and the receiver on {receiver.short()}; use transport auto or gloo"
            )
        return choice
    return offered_kinds(choice, sender)[0] if same_node else offered_kinds(choice, sender)[-1]


@dataclass
class _Recv:
    handles: dict[str, TransferHandle]  # kind -> that backend's handle
    handle: TransferHandle  # the one the caller holds
    started: float  # time.monotonic() at expect()
    final: TransferResult | None = None


@dataclass
class _Link:
    peer: str
    peer_node_id: str
    kind: str
    sub_peer: str  # the backend's own peer id
    blocks: int = 0
    nbytes: int = 0


class PairwiseTransport(KVTransport):
    """The KVTransport a serving worker holds: one backend per peer (see the module doc)."""

    kind = KIND

    @classmethod
    def for_place(cls, place: Place, checksums: bool = True) -> PairwiseTransport:
        return cls(place=place, checksums=checksums)

    def __init__(
        self,
        choice: str = "auto",
        place: Place = LOCAL_PLACE,
        name: str = "",
        checksums: bool = True,
        fault_plan: FaultPlan | None = None,
    ) -> None:
        """`name` is how peers' `links()` call this worker (its worker id in serving).
        `checksums` and `fault_plan` go to every backend (kvtransfer.integrity)."""
        self.place = place
        self.choice = choice
        self.name = name or f"kv-{uuid.uuid4().hex[:8]}"
        self._id = f"{KIND}-{uuid.uuid4().hex[:12]}"
        self._subs: dict[str, KVTransport] = {
            k: transport_for_place(k, place, checksums) for k in offered_kinds(choice, place)
        }
        self.set_fault_plan(fault_plan)
        self._lock = threading.Lock()
        # Held through a whole connect: the first requests to a restarted peer arrive together on
        # several call threads, and two pairs built at once to one peer left transfers hanging.
        self._connecting = threading.Lock()
        self._layout: KVLayout | None = None
        self._num_blocks = 0
        self._links: dict[str, _Link] = {}  # our peer id -> link
        self._sends: OrderedDict[str, str] = OrderedDict()  # transfer id -> our peer id
        self._recvs: OrderedDict[str, _Recv] = OrderedDict()

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._subs)

    def set_fault_plan(self, plan: FaultPlan | None) -> None:
        """Faults to inject into this worker's sends, on every backend (tests)."""
        for sub in self._subs.values():
            sub.set_fault_plan(plan)

    def pending_transfers(self) -> list[str]:
        """Ids of transfers not terminal on any backend (tests check none leak)."""
        return sorted({tid for sub in self._subs.values() for tid in sub.pending_transfers()})

    # -- cache ---------------------------------------------------------------------------
    def allocate_cache(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        first, *others = self._subs.values()
        cache = first.allocate_cache(layout, num_blocks)  # shm: in shared memory, so peers map it
        for sub in others:
            sub.register_cache(cache, layout)
        self._layout, self._num_blocks = layout, num_blocks
        return cache

    def register_cache(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        for sub in self._subs.values():
            sub.register_cache(kv_cache, layout)
        self._layout, self._num_blocks = layout, int(kv_cache.shape[2])

    # -- connections ---------------------------------------------------------------------
    def endpoint(self) -> KVEndpoint:
        if self._layout is None:
            raise ValueError("pairwise transport has no cache: call allocate_cache() first")
        offers = {kind: sub.endpoint() for kind, sub in self._subs.items()}
        address: dict[str, object] = {
            "name": self.name,
            "node_id": self.place.node_id,
            "host": self.place.host,
            "device": self.place.device,
            "offers": offers,
        }
        return KVEndpoint(KIND, self._id, self._layout, self._num_blocks, address)

    def peer_place(self, peer: KVEndpoint) -> Place:
        a = peer.address
        node_id, host, device = a["node_id"], a["host"], a["device"]
        if not (isinstance(node_id, str) and isinstance(host, str) and isinstance(device, str)):
            raise ValueError(f"peer {peer.worker_id}'s address has no node id, host and device: {a}")
        return Place(node_id, host, device)

    def kind_for(self, peer: KVEndpoint) -> str:
        """The backend this worker would use to send to `peer`."""
        if peer.kind != KIND:
            return peer.kind
        return pair_kind(self.choice, self.place, self.peer_place(peer))

    def connect(self, peer: KVEndpoint) -> str:
        if self._layout is None:
            raise ValueError("pairwise transport has no cache: call allocate_cache() first")
        self._layout.check_compatible(peer.layout)  # KVLayoutMismatch names the field
        with self._connecting:
            return self._connect(peer)

    def _connect(self, peer: KVEndpoint) -> str:
        peer_id = f"{peer.kind}:{peer.worker_id}"
        with self._lock:
            link = self._links.get(peer_id)
        if link is not None:
            return peer_id
        kind = self.kind_for(peer)
        if peer.kind == KIND:
            offers, name, node_id = peer.address["offers"], peer.address["name"], peer.address["node_id"]
            if not (isinstance(offers, dict) and isinstance(name, str) and isinstance(node_id, str)):
                raise ValueError(f"peer {peer.worker_id}'s address has no offers, name and node id: {peer.address}")
            sub_endpoint, offered = offers.get(kind), sorted(offers)
        else:  # a plain backend endpoint (tests, tools)
            sub_endpoint, name, node_id, offered = peer, peer.worker_id, "?", [peer.kind]
        sub = self._subs.get(kind)
        if sub is None or sub_endpoint is None:
            raise KVTransferError(
                f"{self.name} ({self.place.short()}) needs {kind} to reach {name}, "
                f"which offers {offered}; this side has {list(self._subs)}"
            )
        sub_peer = sub.connect(sub_endpoint)
        with self._lock:
            self._links[peer_id] = _Link(name, node_id, kind, sub_peer)
        return peer_id

    def links(self) -> list[PeerLink]:
        with self._lock:
            return [PeerLink(k.peer, k.peer_node_id, k.kind, k.blocks, k.nbytes) for k in self._links.values()]

    # -- sending ---------------------------------------------------------------------------
    def send(
        self,
        peer_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float,
    ) -> TransferHandle:
        with self._lock:
            link = self._links.get(peer_id)
        if link is None:
            raise ValueError(f"unknown peer {peer_id!r}: call connect() with its endpoint first")
        handle = self._subs[link.kind].send(link.sub_peer, src_block_ids, dst_block_ids, transfer_id, timeout_s)
        with self._lock:
            self._sends[transfer_id] = peer_id
            _bound(self._sends)
        return handle

    def _sent(self, handle: TransferHandle) -> tuple[KVTransport, _Link]:
        with self._lock:
            peer_id = self._sends.get(handle.transfer_id)
            link = self._links.get(peer_id) if peer_id is not None else None
        if link is None:
            raise ValueError(f"unknown transfer {handle.transfer_id!r} (send) on this pairwise transport")
        return self._subs[link.kind], link

    def _count(self, handle: TransferHandle, link: _Link, status: TransferStatus, nbytes: int) -> None:
        """Once per finished send: credit the link that carried it."""
        if not status.is_terminal:
            return
        with self._lock:
            if self._sends.pop(handle.transfer_id, None) is not None and status == TransferStatus.SUCCESS:
                link.blocks += handle.num_blocks
                link.nbytes += nbytes

    # -- receiving -------------------------------------------------------------------------
    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> TransferHandle:
        handles: dict[str, TransferHandle] = {}
        try:
            for kind, sub in self._subs.items():
                handles[kind] = sub.expect(transfer_id, dst_block_ids, timeout_s)
        except BaseException:
            for kind in handles:
                self._subs[kind].abort(transfer_id)
            raise
        first = next(iter(handles.values()))
        handle = TransferHandle(transfer_id, TransferSide.RECV, first.num_blocks, first.nbytes, first.deadline)
        with self._lock:
            self._recvs[transfer_id] = _Recv(handles, handle, time.monotonic())
            _bound(self._recvs)
        return handle

    def _recv(self, transfer_id: str) -> _Recv:
        with self._lock:
            recv = self._recvs.get(transfer_id)
        if recv is None:
            raise ValueError(f"unknown transfer {transfer_id!r} (recv) on this pairwise transport")
        return recv

    def _settle(self, recv: _Recv) -> TransferStatus:
        """Look at every backend once; end the transfer when one succeeded or failed."""
        if recv.final is not None:
            return recv.final.status
        statuses = {kind: self._subs[kind].poll(h) for kind, h in recv.handles.items()}
        done = [k for k, s in statuses.items() if s == TransferStatus.SUCCESS] or [
            k for k, s in statuses.items() if s.is_terminal
        ]
        if not done:
            return max(statuses.values())
        kind = done[0]
        result = self._subs[kind].wait(recv.handles[kind], 0)
        for other in recv.handles:
            if other != kind:
                self._subs[other].abort(recv.handle.transfer_id)  # nothing late lands in the blocks
        recv.final = TransferResult(
            result.transfer_id,
            TransferSide.RECV,
            result.status,
            result.nbytes,
            result.seconds,
            result.error if result.ok else f"{kind}: {result.error}",
            result.reason,
        )
        return result.status

    # -- both sides --------------------------------------------------------------------------
    def poll(self, handle: TransferHandle) -> TransferStatus:
        if handle.role == TransferSide.SEND:
            sub, link = self._sent(handle)
            status = sub.poll(handle)
            if status.is_terminal:
                self._count(handle, link, status, sub.wait(handle, 0).nbytes)
            return status
        return self._settle(self._recv(handle.transfer_id))

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferResult:
        if handle.role == TransferSide.SEND:
            sub, link = self._sent(handle)
            result = sub.wait(handle, timeout_s)
            self._count(handle, link, result.status, result.nbytes)
            return result
        recv = self._recv(handle.transfer_id)
        if len(recv.handles) == 1:  # one backend: its own wait, no polling here
            ((kind, h),) = recv.handles.items()
            self._subs[kind].wait(h, timeout_s)
        give_up = None if timeout_s is None else time.monotonic() + max(0.0, float(timeout_s))
        pause = 0.0002
        while True:
            status = self._settle(recv)
            if recv.final is not None:
                return recv.final
            if give_up is not None and time.monotonic() >= give_up:
                return TransferResult(handle.transfer_id, TransferSide.RECV, status, 0, time.monotonic() - recv.started)
            # Backends finish on their own threads (or in the peer's process, for shm): poll in
            # short growing slices, as TransportCore.wait does.
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def abort(self, transfer_id: str) -> None:
        check_transfer_id(transfer_id)
        for sub in self._subs.values():
            sub.abort(transfer_id)
        with self._lock:
            recv = self._recvs.get(transfer_id)
        if recv is not None:
            self._settle(recv)

    def handle_for(self, transfer_id: str, role: TransferSide) -> TransferHandle:
        if role == TransferSide.RECV:
            return self._recv(transfer_id).handle
        with self._lock:
            peer_id = self._sends.get(transfer_id)
        if peer_id is None:
            raise ValueError(f"unknown transfer {transfer_id!r} ({role.value})")
        return self._subs[self._links[peer_id].kind].handle_for(transfer_id, role)

    def close(self) -> None:
        # The first backend owns the cache memory (shm's segment): close it last.
        for sub in reversed(list(self._subs.values())):
            sub.close()


def _bound(table: OrderedDict) -> None:
    """Keep a routing table from growing without limit when callers never look at results."""
    while len(table) > MAX_FINISHED_RECORDS:
        table.popitem(last=False)
