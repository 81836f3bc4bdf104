"""End-to-end integrity of a KV transfer, and the faults tests inject to prove it.

The sender sums every block as it packs or copies it (kernels.block_checksum: per-block sums of
64-bit words with position weights, taken inside the native copy) and sends a `Manifest`: the
transfer's key, the layout's tag, how many blocks it vouches for, and one *seal* per block, which
mixes the block's sums with its position in the transfer, the transfer's key and the layout tag.
The receiver sums the bytes it got, seals them the same way and compares (`verify`) before the
transfer may count as SUCCESS, so a sequence never runs on KV that differs from what was sent:
flipped bits, a missing, stale or truncated block, blocks swapped or duplicated, a manifest meant
for another request or layout all fail with a `FailureReason`, as does a deadline that passed
before the data was complete (late data is never written).

Why this is end to end: the two sums are taken by different processes from different reads. The
sender's are of its source bytes as its copy or pack reads them; the receiver's are of bytes it
reads itself after they landed: on shared memory its own cache blocks (the segment *is* the
decode worker's cache, the sender writes into it directly, so there is no receiver copy whose
loads could be summed on the way, and the receiver reads the destination as it lies); on gloo and
NCCL the staging buffer the payload arrived in, before the unpack copies it into the cache
(kvtransfer._staged). A match therefore covers the sender's reads, the copy's addressing (which
block went where), the bytes in transit and in the destination until the receiver read them, and
the transfer's identity and layout through the seal; only the unpack's own stores (gloo, NCCL) and
memory changed after the receiver's read are left to the hardware (ECC) and the block manager.
The receiver's read costs one pass over the transfer's bytes at memory speed; the shm receiver
overlaps it with the copy (kvtransfer.shm), but the two compete for memory, so on a 2-core host
the check still adds about a quarter to a 16 MiB handoff even with the sender's sums taken
beforehand (bench/kv_checksum_pull.py; bench/kv_transfer.py --checksum-cost for today's).

Fault injection is configuration of a transport (`FaultPlan`, passed to its constructor or
`set_fault_plan`), never read from the environment: each backend applies the planned fault where
its data path would suffer it (the bytes delivered, the manifest, the timing, the sender's life).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from common.protocol import KVLayout


class FailureReason(str, enum.Enum):
    """Why a transfer failed (the `reason` label of `baton:kv_transfer_failures_total`)."""

    CHECKSUM = "checksum"  # a block's bytes differ from what the sender sealed
    INCOMPLETE = "incomplete"  # fewer blocks vouched for than reserved: short or missing data
    FOREIGN_REQUEST = "foreign_request"  # data or manifest of another transfer
    FOREIGN_LAYOUT = "foreign_layout"  # data packed for another cache layout
    IDS_MISMATCH = "ids_mismatch"  # sender and receiver disagree about the destination blocks
    DEADLINE = "deadline"  # not complete (and verified) before the deadline; late data is dropped
    SENDER_FAILED = "sender_failed"  # the sender or its link to us failed
    ABORTED = "aborted"


FAILURE_REASONS = tuple(r.value for r in FailureReason)


class FaultKind(str, enum.Enum):
    FLIP = "flip"  # flip one bit of one block after it was summed
    DROP = "drop"  # one block never arrives (the receiver keeps what its slot held)
    TRUNCATE = "truncate"  # the last block is cut off and the manifest vouches for one block less
    REORDER = "reorder"  # two neighbouring blocks land in each other's place
    DUPLICATE = "duplicate"  # one block arrives twice, the second time in its neighbour's place
    FOREIGN_REQUEST = "foreign_request"  # the manifest is another transfer's
    FOREIGN_LAYOUT = "foreign_layout"  # the manifest is for another layout
    STALL = "stall"  # the data leaves only after the deadline (plus stall_s)
    KILL = "kill"  # the sender dies mid-transfer: part of the data, no completion


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    block: int = 0  # which block of the transfer (clamped to the transfer's blocks)
    bit: int = 0  # FLIP: which bit of that block's first piece (mod its size)
    stall_s: float = 0.05  # STALL: how long past the deadline the data leaves

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise ValueError(f"fault kind must be a FaultKind, got {self.kind!r}")
        if self.block < 0 or self.bit < 0 or self.stall_s < 0:
            raise ValueError(f"fault block, bit and stall_s must be >= 0, got {self!r}")


@dataclass(frozen=True)
class FaultPlan:
    """Which transfers (by id) suffer which fault; the others run clean."""

    faults: Mapping[str, Fault] = field(default_factory=dict)

    def fault_for(self, transfer_id: str) -> Fault | None:
        return self.faults.get(transfer_id)


def layout_tag(layout: KVLayout) -> int:
    """63-bit tag of everything that decides how a block's bytes are read."""
    fields: tuple[object, ...] = (
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.dtype,
        tuple(layout.kv_scales),
    )
    if layout.kv_heads is not None:  # a tensor-parallel rank's heads: another rank's bytes read wrong
        fields += (layout.kv_heads,)
    text = repr(fields)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: every input bit reaches every output bit.
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def seal(sums: np.ndarray, key: int, tag: int, first: int = 0) -> np.ndarray:
    """uint64 `[n]` seals of blocks at positions first.. first + n - 1 of transfer `key`, from
    their (s1, s2) sums `[n, 2]` (kernels.block_checksum)."""
    n = sums.shape[0]
    with np.errstate(over="ignore"):
        pos = (np.arange(first + 1, first + n + 1, dtype=np.uint64) * _GOLDEN) ^ np.uint64(key) ^ np.uint64(tag)
        return _mix(sums[:, 0] + _mix(sums[:, 1] ^ _mix(pos)))


@dataclass(frozen=True)
class Manifest:
    """What the sender vouches for: `nblocks` blocks of transfer `key` for layout `tag`."""

    key: int
    tag: int
    nblocks: int
    seals: bytes  # little-endian uint64 per block, in transfer order

    @classmethod
    def of(cls, sums: np.ndarray, key: int, tag: int) -> Manifest:
        return cls(key, tag, int(sums.shape[0]), seal(sums, key, tag).astype("<u8").tobytes())

    def seal_array(self) -> np.ndarray:
        return np.frombuffer(self.seals, dtype="<u8")


@dataclass(frozen=True)
class Verdict:
    reason: FailureReason
    message: str


def verify(manifest: Manifest, key: int, tag: int, nblocks: int, received: np.ndarray) -> Verdict | None:
    """None when the `received` sums `[nblocks, 2]` are what `manifest` vouches for."""
    if manifest.key != key:
        return Verdict(FailureReason.FOREIGN_REQUEST, "the manifest belongs to another transfer")
    if manifest.tag != tag:
        return Verdict(FailureReason.FOREIGN_LAYOUT, "the data was packed for another KV layout")
    if manifest.nblocks != nblocks or len(manifest.seals) != 8 * nblocks:
        return Verdict(FailureReason.INCOMPLETE, f"the sender vouches for {manifest.nblocks} of {nblocks} blocks")
    bad = np.flatnonzero(seal(received, key, tag) != manifest.seal_array())
    if len(bad):
        return Verdict(
            FailureReason.CHECKSUM,
            f"checksum mismatch in {len(bad)} of {nblocks} blocks (first at position {int(bad[0])})",
        )
    return None


def clamp_block(fault: Fault, n: int) -> int:
    return min(fault.block, max(0, n - 1))


def faulty_pairs(fault: Fault | None, src: list[int], dst: list[int]) -> tuple[list[int], list[int]]:
    """The (src, dst) block pairs that a delivery suffering `fault` actually writes."""
    if fault is None or len(src) < 1:
        return src, dst
    b = clamp_block(fault, len(src))
    if fault.kind == FaultKind.DROP:
        return src[:b] + src[b + 1 :], dst[:b] + dst[b + 1 :]
    if fault.kind == FaultKind.TRUNCATE:
        return src[:-1], dst[:-1]
    if fault.kind == FaultKind.KILL:
        half = len(src) // 2
        return src[:half], dst[:half]
    if len(src) >= 2 and fault.kind in (FaultKind.REORDER, FaultKind.DUPLICATE):
        b = min(b, len(src) - 2)
        s = list(src)
        if fault.kind == FaultKind.REORDER:
            s[b], s[b + 1] = s[b + 1], s[b]
        else:
            s[b + 1] = s[b]
        return s, dst
    return src, dst


def faulty_manifest(fault: Fault | None, manifest: Manifest) -> Manifest:
    """The manifest as a receiver suffering `fault` gets it."""
    if fault is None:
        return manifest
    if fault.kind == FaultKind.TRUNCATE:
        return Manifest(manifest.key, manifest.tag, manifest.nblocks - 1, manifest.seals[:-8])
    if fault.kind == FaultKind.FOREIGN_REQUEST:
        return Manifest(manifest.key ^ 0x5A5A, manifest.tag, manifest.nblocks, manifest.seals)
    if fault.kind == FaultKind.FOREIGN_LAYOUT:
        return Manifest(manifest.key, manifest.tag ^ 0x3C3C, manifest.nblocks, manifest.seals)
    return manifest


def flip_bit(rows: np.ndarray, block: int, bit: int) -> None:
    """Flip bit `bit` (mod the piece size) of the first piece of block `block` in a numpy
    `[rows, num_blocks, P]` uint8 view."""
    nbits = rows.shape[2] * 8
    bit %= nbits
    rows[0, block, bit // 8] ^= np.uint8(1 << (bit % 8))


def unplanned_fault(fault: Fault | None, n: int) -> bool:
    """Whether `fault` cannot act on a transfer of n blocks (reorder/duplicate need two)."""
    return fault is not None and n < 2 and fault.kind in (FaultKind.REORDER, FaultKind.DUPLICATE)
