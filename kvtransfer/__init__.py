"""Moving paged KV blocks between workers: one interface, several backends.

Decode worker D (receiver) and prefill worker P (sender), e.g. two Ray actors:

    # D, at start-up: its cache lives where the backend wants it (shared memory for shm)
    t = create_transport(default_kind())             # nccl on CUDA, else shm
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                      dtype="float32")               # FP8: dtype + kv_scales per layer
    kv_cache = t.allocate_cache(layout, num_blocks)  # or t.register_cache(tensor, layout)
    endpoint = t.endpoint()                          # picklable; hand it to P through Ray
    # D, per request: reserve blocks, then announce them
    h = t.expect(request_id, dst_block_ids, timeout_s=30)
    ... t.poll(h) / t.wait(h) -> SUCCESS: move the sequence to RUNNING; t.abort(request_id)

    # P, once per decode worker
    peer = t.connect(endpoint)                       # layout handshake, KVLayoutMismatch
    # P, after prefill
    h = t.send(peer, src_block_ids, dst_block_ids, request_id, timeout_s=30)
    result = t.wait(h)                               # TransferResult(status, nbytes, seconds)

Serving workers hold a `PairwiseTransport` (`kvtransfer.pairwise`): it picks the backend per
pair of workers from both workers' `Place` (Ray node id, node IP, device): shm inside a node
and gloo across nodes on the CPU, nccl on GPUs; `pair_kind()` is that rule.

Every transfer is checksummed end to end and verified by the receiver before it is SUCCESS
(`kvtransfer.integrity`: failure reasons, and the `FaultPlan` tests inject faults with).
Backends are registered by kind in `kvtransfer.registry` (the built-ins below, once); both
`create_transport` and the pairwise transport build from that table. See `kvtransfer.base` for the
interface, `common.protocol` for the torch-free layout and endpoint, and `bench/kv_transfer.py` for
the numbers behind the CPU default.
"""

from __future__ import annotations

import torch

from common.protocol import KVEndpoint, KVLayout, KVLayoutMismatch

from .base import (
    KVTransferError,
    KVTransport,
    TransferHandle,
    TransferResult,
    TransferSide,
    TransferStatus,
    check_cache,
    dtype_name,
    layout_from_cache,
    torch_dtype,
)
from .gloo import GlooTransport
from .inprocess import InProcessTransport
from .integrity import FailureReason, Fault, FaultKind, FaultPlan
from .nccl import NcclTransport
from .pairwise import PairwiseTransport, PeerLink, Place, offered_kinds, pair_kind
from .registry import create_transport, register_transport, transport_class, transport_kinds
from .shm import ShmTransport

# shm between workers on one node: one copy into the peer's mapped cache, where gloo pays a
# pack, the socket and an unpack (bench/kv_transfer.py). gloo is for workers on different nodes.
CPU_DEFAULT = "shm"
# The built-in backends, registered once (kvtransfer.registry; their kinds are common.transports.BACKENDS).
for _backend in (InProcessTransport, ShmTransport, GlooTransport, NcclTransport, PairwiseTransport):
    register_transport(_backend.kind, _backend)


def default_kind() -> str:
    """The one backend for a process that talks to peers of its own kind: nccl on CUDA, else shm.
    (Serving workers choose per pair instead: `PairwiseTransport`, `common.transports.CHOICES`.)"""
    return "nccl" if torch.cuda.is_available() else CPU_DEFAULT


__all__ = [
    "CPU_DEFAULT",
    "FailureReason",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "KVEndpoint",
    "KVLayout",
    "KVLayoutMismatch",
    "KVTransferError",
    "KVTransport",
    "PairwiseTransport",
    "PeerLink",
    "Place",
    "TransferSide",
    "TransferHandle",
    "TransferResult",
    "TransferStatus",
    "check_cache",
    "create_transport",
    "register_transport",
    "transport_class",
    "transport_kinds",
    "default_kind",
    "dtype_name",
    "offered_kinds",
    "pair_kind",
    "layout_from_cache",
    "torch_dtype",
]
