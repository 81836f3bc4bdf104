"""Moving paged KV blocks between workers: one interface, several backends.

Decode worker D (receiver) and prefill worker P (sender), e.g. two Ray actors:

    # D, at start-up: its cache lives where the backend wants it (shared memory for shm)
    t = create_transport("auto")                     # nccl on CUDA, else shm
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

See `kvtransfer.base` for the interface and `bench/kv_transfer.py` for the numbers behind the
CPU default.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import (
    KVEndpoint,
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    KVTransport,
    Role,
    TransferHandle,
    TransferResult,
    TransferStatus,
)

# Chosen from bench/kv_transfer.py (bench/results/kv_transfer.json, 2-core dev VM): between
# two actors, shm moved 1-64 MiB of contiguous block ids at 0.5-0.9x an in-process memcpy
# (isolated; 0.9-1.0x back-to-back) and scattered ids at 0.36-0.6x (the memory system's
# cost of one 8 KiB stream per block and layer); gloo over loopback TCP pays a pack, the
# socket and an unpack and stayed near 0.1x. gloo remains the choice when the two workers
# do not share a node.
CPU_DEFAULT = "shm"
KINDS = ("auto", "inprocess", "shm", "gloo", "nccl")


def default_kind() -> str:
    return "nccl" if torch.cuda.is_available() else CPU_DEFAULT


def create_transport(kind: str = "auto", **options: Any) -> KVTransport:
    """Build a transport. `options` go to the backend's constructor, e.g. `host=` for gloo/nccl
    (address to bind and advertise), `fault=` for inprocess, `num_slots=` for shm."""
    if kind not in KINDS:
        raise ValueError(f"unknown KV transport {kind!r}; expected one of {KINDS}")
    if kind == "auto":
        kind = default_kind()
    if kind == "inprocess":
        from .inprocess import InProcessTransport
        return InProcessTransport(**options)
    if kind == "shm":
        from .shm import ShmTransport
        return ShmTransport(**options)
    if kind == "gloo":
        from .gloo import GlooTransport
        return GlooTransport(**options)
    from .gloo import NcclTransport
    return NcclTransport(**options)


__all__ = [
    "CPU_DEFAULT",
    "KINDS",
    "KVEndpoint",
    "KVLayout",
    "KVLayoutMismatch",
    "KVTransferError",
    "KVTransport",
    "Role",
    "TransferHandle",
    "TransferResult",
    "TransferStatus",
    "create_transport",
    "default_kind",
]
