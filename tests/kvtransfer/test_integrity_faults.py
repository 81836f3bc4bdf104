"""End-to-end KV integrity under injected faults, on every CPU backend (both sides in this
process: the data path and the checks are the same code as across processes).

1,000 handoffs per backend, one in three with a fault (every kind, in turn), the rest clean. The
oracle is the bytes themselves: a clean handoff must land bit-exact in the receiver's blocks and
be SUCCESS there; a faulty one must be FAILED on the receiver with the reason its fault implies.
Blocks come from a free list on each side and go back only once that side's transfer is
terminal; at the end both free lists are whole and neither transport has a live transfer.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

from kernels.block_checksum import sums_of_rows
from kvtransfer import KVLayout, TransferStatus, create_transport
from kvtransfer.integrity import FailureReason, Fault, FaultKind, FaultPlan, Manifest, seal, verify

pytestmark = pytest.mark.slow  # a thousand handoffs with injected faults per backend, gloo too: about 20 s here

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32")
NUM_BLOCKS = 96
HANDOFFS = 1000
EXPECTED = {
    FaultKind.FLIP: FailureReason.CHECKSUM,
    FaultKind.DROP: FailureReason.CHECKSUM,
    FaultKind.REORDER: FailureReason.CHECKSUM,
    FaultKind.DUPLICATE: FailureReason.CHECKSUM,
    FaultKind.TRUNCATE: FailureReason.INCOMPLETE,
    FaultKind.FOREIGN_REQUEST: FailureReason.FOREIGN_REQUEST,
    FaultKind.FOREIGN_LAYOUT: FailureReason.FOREIGN_LAYOUT,
    FaultKind.STALL: FailureReason.DEADLINE,
}
# A killed sender: the receiver either sees its link break (gloo) or runs into the deadline.
KILLED = {FailureReason.DEADLINE.value, FailureReason.SENDER_FAILED.value}
KINDS = list(FaultKind)


def rows(cache: torch.Tensor) -> np.ndarray:
    b = cache.view(torch.uint8)
    return b.numpy().reshape(b.shape[0] * 2, b.shape[2], -1)


def plan_handoffs(seed: int) -> list[tuple[str, list[int], list[int], Fault | None]]:
    rng = random.Random(seed)
    out = []
    for i in range(HANDOFFS):
        n = rng.randint(2, 5)
        src = rng.sample(range(NUM_BLOCKS // 2), n)
        dst = rng.sample(range(NUM_BLOCKS // 2), n)
        fault = None
        if i % 3 == 0:
            kind = KINDS[(i // 3) % len(KINDS)]
            fault = Fault(kind, block=rng.randrange(n), bit=rng.randrange(LAYOUT.block_bytes // 4 * 8), stall_s=0.02)
        out.append((f"h{i}", src, dst, fault))
    return out


@pytest.mark.parametrize("backend", ["inprocess", "shm", "gloo"])
def test_every_injected_fault_is_detected_and_nothing_leaks(backend):
    handoffs = plan_handoffs(seed=27)
    plan = FaultPlan({tid: fault for tid, _, _, fault in handoffs if fault is not None})
    # shm: one block per chunk, so that every handoff lands in several chunks that the receiver's
    # verifier thread may sum while the copy runs (kvtransfer.shm), faulty ones included.
    options = {"verify_chunk_bytes": LAYOUT.block_bytes} if backend == "shm" else {}
    sender, receiver = create_transport(backend, fault_plan=plan, **options), create_transport(backend, **options)
    try:
        src_cache = sender.allocate_cache(LAYOUT, NUM_BLOCKS)
        dst_cache = receiver.allocate_cache(LAYOUT, NUM_BLOCKS)
        src_cache.view(torch.uint8).view(-1).copy_(
            torch.randint(
                0, 256, (src_cache.numel() * 4,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8
            )
        )
        endpoint = receiver.endpoint()
        peer = sender.connect(endpoint)
        src_rows, dst_rows = rows(src_cache), rows(dst_cache)
        # Each side's blocks in use, as a block manager would track them: taken at the start of a
        # handoff, given back only once that side's transfer is terminal.
        src_free, dst_free = set(range(NUM_BLOCKS)), set(range(NUM_BLOCKS))
        seen: dict[FaultKind, int] = {}
        started = time.monotonic()
        for tid, src, dst, fault in handoffs:
            src_free -= set(src)
            dst_free -= set(dst)
            dst_rows[:, dst] = 0xEE  # what the reserved blocks held: never what is sent
            timeout = 0.05 if fault is not None and fault.kind in (FaultKind.STALL, FaultKind.KILL) else 10.0
            recv = receiver.expect(tid, dst, timeout)
            send = sender.send(peer, src, dst, tid, timeout)
            got = receiver.wait(recv)
            sent = sender.wait(send)
            assert got.status.is_terminal and sent.status.is_terminal, (tid, got, sent)
            src_free |= set(src)
            dst_free |= set(dst)
            landed = np.array_equal(dst_rows[:, dst], src_rows[:, src])
            if fault is None:
                assert got.status == TransferStatus.SUCCESS, (tid, got)
                assert sent.status == TransferStatus.SUCCESS, (tid, sent)
                assert landed, f"{tid}: SUCCESS but the bytes differ"
            else:
                seen[fault.kind] = seen.get(fault.kind, 0) + 1
                assert got.status == TransferStatus.FAILED, (tid, fault, got)
                want = KILLED if fault.kind == FaultKind.KILL else {EXPECTED[fault.kind].value}
                assert got.reason in want, (tid, fault, got)
                if fault.kind == FaultKind.KILL and backend == "gloo":
                    peer = sender.connect(endpoint)  # the dead sender's pair is gone: a new one
        elapsed = time.monotonic() - started
        assert set(seen) == set(FaultKind) and min(seen.values()) >= 30, seen
        assert src_free == dst_free == set(range(NUM_BLOCKS))
        assert sender.pending_transfers() == [] and receiver.pending_transfers() == []
        if backend == "shm":  # no slot left mid-transfer (the killed sends' slots were failed by the receiver)
            from kvtransfer._segment import KEY, STATE

            slots = receiver._own.slots
            live = slots[
                (slots[:, KEY] != 0)
                & np.isin(slots[:, STATE], [int(TransferStatus.PENDING), int(TransferStatus.TRANSFERRING)])
            ]
            assert len(live) == 0, live
        if backend == "gloo":
            assert all(not out.in_flight for out in sender._out.values() if out.broken is None)
            assert all(not inp.parked for inp in receiver._in.values())
        assert elapsed < 60, f"{HANDOFFS} handoffs took {elapsed:.1f}s"
    finally:
        sender.close()
        receiver.close()


def test_shm_receiver_verifies_without_being_asked():
    """The receiver's verifier thread sums the chunks as they land and lands the transfer itself:
    nobody on the receiving side calls wait() or poll(), yet its record turns SUCCESS (and FAILED
    for a flipped bit), and the FIFO that wakes the thread goes with the segment."""
    from kvtransfer._segment import wake_path

    plan = FaultPlan({"bad": Fault(FaultKind.FLIP, block=3, bit=5)})
    sender = create_transport("shm", fault_plan=plan, verify_chunk_bytes=2 * LAYOUT.block_bytes)
    receiver = create_transport("shm")
    try:
        src = sender.allocate_cache(LAYOUT, 16)
        receiver.allocate_cache(LAYOUT, 16)
        src.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (src.numel() * 4,), dtype=torch.uint8))
        peer = sender.connect(receiver.endpoint())
        path = receiver.endpoint().address["path"]
        assert os.path.exists(wake_path(path))
        handles = {
            tid: receiver.expect(tid, list(range(8)) if tid == "good" else list(range(8, 16)), 5.0)
            for tid in ("good", "bad")
        }
        for tid, dst in (("good", range(8)), ("bad", range(8, 16))):
            assert sender.wait(sender.send(peer, list(range(8)), list(dst), tid, 5.0)).ok
        deadline = time.monotonic() + 5
        while receiver.pending_transfers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.pending_transfers() == []
        assert receiver.wait(handles["good"]).ok
        bad = receiver.wait(handles["bad"])
        assert bad.status == TransferStatus.FAILED and bad.reason == FailureReason.CHECKSUM.value, bad
    finally:
        sender.close()
        receiver.close()
    assert not os.path.exists(path) and not os.path.exists(wake_path(path))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_sweep_removes_a_dead_segments_fifo_without_opening_it(tmp_path):
    """A FIFO left by a killed owner goes with its segment; opening it to read a header would block."""
    from kvtransfer._segment import sweep_stale_segments, wake_path

    live, orphan = tmp_path / "baton_kv_live", tmp_path / "baton_kv_gone"
    live.write_bytes(b"")  # no header yet: a segment being created, left alone
    for segment in (live, orphan):
        os.mkfifo(wake_path(str(segment)))
    sweep_stale_segments(str(tmp_path))
    assert os.path.exists(wake_path(str(live))) and live.exists()
    assert not os.path.exists(wake_path(str(orphan)))


def test_checksums_off_still_moves_bytes_and_skips_verification():
    sender, receiver = create_transport("shm", checksums=False), create_transport("shm")
    try:
        src = sender.allocate_cache(LAYOUT, 8)
        dst = receiver.allocate_cache(LAYOUT, 8)
        src.view(torch.uint8).view(-1).copy_(
            torch.arange(src.numel() * 4, dtype=torch.int64).remainder(251).to(torch.uint8)
        )
        peer = sender.connect(receiver.endpoint())
        h = receiver.expect("x", [3, 4], 5.0)
        assert sender.wait(sender.send(peer, [1, 2], [3, 4], "x", 5.0)).ok
        assert receiver.wait(h).ok
        assert np.array_equal(rows(dst)[:, [3, 4]], rows(src)[:, [1, 2]])
    finally:
        sender.close()
        receiver.close()


def test_seal_verify_catches_each_single_bit_flip_of_a_block():
    """Against a hand-built oracle: flipping any one bit of a block's bytes fails verify."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, size=(4, 1, 24), dtype=np.uint8)  # 4 rows, one block, 24-byte pieces
    sums = sums_of_rows(block, [0])
    manifest = Manifest.of(sums, key=7, tag=9)
    assert verify(manifest, 7, 9, 1, sums) is None
    for r in range(4):
        for bit in range(24 * 8):
            flipped = block.copy()
            flipped[r, 0, bit // 8] ^= 1 << (bit % 8)
            verdict = verify(manifest, 7, 9, 1, sums_of_rows(flipped, [0]))
            assert verdict is not None and verdict.reason == FailureReason.CHECKSUM
    # The same bytes at another position of the transfer, or for another key, seal differently.
    assert seal(sums, 7, 9, first=1)[0] != seal(sums, 7, 9)[0]
    assert seal(sums, 8, 9)[0] != seal(sums, 7, 9)[0]
