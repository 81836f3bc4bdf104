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
See `kvtransfer.base` for the interface, `common.protocol` for the torch-free layout and
endpoint, and `bench/kv_transfer.py` for the numbers behind the CPU default.
"""

from __future__ import annotations

from typing import Any

import torch

from common.protocol import KVEndpoint, KVLayout, KVLayoutMismatch
from common.transports import BACKENDS

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
from .shm import ShmTransport

# shm between workers on one node: one copy into the peer's mapped cache, where gloo pays a
# pack, the socket and an unpack (bench/kv_transfer.py). gloo is for workers on different nodes.
CPU_DEFAULT = "shm"
_BACKENDS: dict[str, type[KVTransport]] = {
    "inprocess": InProcessTransport,
    "shm": ShmTransport,
    "gloo": GlooTransport,
    "nccl": NcclTransport,
    "pairwise": PairwiseTransport,
}


def default_kind() -> str:
    """The one backend for a process that talks to peers of its own kind: nccl on CUDA, else shm.
    (Serving workers choose per pair instead: `PairwiseTransport`, `common.transports.CHOICES`.)"""
    return "nccl" if torch.cuda.is_available() else CPU_DEFAULT


def create_transport(kind: str, **options: Any) -> KVTransport:
    """Build the backend `kind` (one of `common.transports.BACKENDS`). `options` go to its
    constructor, e.g. `host=` for gloo/nccl (address to bind and advertise), `fault=` for
    inprocess, `num_slots=` and `verify_chunk_bytes=` for shm, `choice=`, `place=` and `name=`
    for pairwise (the one serving workers use); every backend takes `checksums=` (seal what it
    sends, default on) and `fault_plan=` (a FaultPlan of faults to inject, tests:
    kvtransfer.integrity)."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown KV transport {kind!r}; expected one of {BACKENDS}")
    return _BACKENDS[kind](**options)


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
    "default_kind",
    "dtype_name",
    "offered_kinds",
    "pair_kind",
    "layout_from_cache",
    "torch_dtype",
]
