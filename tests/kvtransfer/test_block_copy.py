"""Block copies with every run structure, and the shm send path's slot table and abort race.

Expected caches are built block by block in the test, independently of `coalesce` and of
the run-wise copy. The shm tests run two transports in this process (the mechanism is the
same as between processes: both sides map the receiver's segment file)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kernels import cpu_native
from kvtransfer import KVLayout, TransferStatus, create_transport, torch_dtype
from kvtransfer._common import block_rows, coalesce, copy_blocks, copy_runs, transfer_key
from testkit.kvtransfer import seeded_bytes

NUM_BLOCKS = 24
LAYOUTS = [
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"),
    KVLayout(num_layers=3, num_kv_heads=1, head_dim=16, block_size=2, dtype="bfloat16"),
    KVLayout(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype="float8_e4m3fn",
        kv_scales=((0.5, 0.25), (2.0, 1.5)),
    ),
]
F32 = LAYOUTS[0]

# (src ids, dst ids): runs on both sides, on one side only, broken at different places on
# each side, reversed, repeated source blocks, single blocks, everything.
STRUCTURES = {
    "both_one_run": (list(range(3, 11)), list(range(12, 20))),
    "src_run_dst_scattered": (list(range(4, 9)), [20, 2, 17, 9, 0]),
    "src_scattered_dst_run": ([20, 2, 17, 9, 0], list(range(4, 9))),
    "runs_break_differently": ([0, 1, 2, 3, 7, 8, 9], [10, 11, 5, 6, 7, 8, 20]),
    "reversed": (list(range(9, 1, -1)), list(range(2, 10))),
    "repeated_src": ([5, 5, 6, 5], [0, 1, 2, 3]),
    "single": ([23], [0]),
    "all_blocks_shuffled": (
        random.Random(1).sample(range(NUM_BLOCKS), NUM_BLOCKS),
        random.Random(2).sample(range(NUM_BLOCKS), NUM_BLOCKS),
    ),
}


def cache(layout: KVLayout, seed: int) -> torch.Tensor:
    flat = seeded_bytes(layout, NUM_BLOCKS, seed)
    return flat.view(torch_dtype(layout)).view(layout.cache_shape(NUM_BLOCKS)).clone()


def expected(dst: torch.Tensor, dst_ids, src: torch.Tensor, src_ids) -> torch.Tensor:
    out = dst.view(torch.uint8).clone()
    src_bytes = src.view(torch.uint8)
    for s, d in zip(src_ids, dst_ids):
        out[:, :, d] = src_bytes[:, :, s]
    return out


def test_coalesce_finds_runs_present_on_both_sides():
    assert coalesce([], []) == []
    assert coalesce([4], [9]) == [(4, 9, 1)]
    assert coalesce(range(3), range(5, 8)) == [(0, 5, 3)]
    assert coalesce([0, 1, 2, 3, 7, 8, 9], [10, 11, 5, 6, 7, 8, 20]) == [(0, 10, 2), (2, 5, 2), (7, 7, 2), (9, 20, 1)]
    assert coalesce([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert coalesce([5, 5, 6], [0, 1, 2]) == [(5, 0, 1), (5, 1, 2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda la: la.dtype)
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_copy_blocks_lands_exactly(layout, structure):
    src_ids, dst_ids = STRUCTURES[structure]
    src, dst = cache(layout, 1), cache(layout, 2)
    want = expected(dst, dst_ids, src, src_ids)
    copy_blocks(dst.view(torch.uint8), dst_ids, src.view(torch.uint8), src_ids)
    assert torch.equal(dst.view(torch.uint8), want)
    assert torch.equal(src.view(torch.uint8), cache(layout, 1).view(torch.uint8))  # only read


def test_copy_runs_between_caches_of_different_sizes():
    src = cache(F32, 3)
    big = torch.zeros(F32.cache_shape(2 * NUM_BLOCKS), dtype=torch.float32)
    src_ids, dst_ids = [0, 1, 2, 9], [40, 41, 47, 3]
    want = big.view(torch.uint8).clone()
    for s, d in zip(src_ids, dst_ids):
        want[:, :, d] = src.view(torch.uint8)[:, :, s]
    copy_runs(block_rows(big.view(torch.uint8)), block_rows(src.view(torch.uint8)), coalesce(src_ids, dst_ids))
    assert torch.equal(big.view(torch.uint8), want)


def test_block_rows_refuses_non_contiguous():
    with pytest.raises(ValueError, match="contiguous CPU"):
        block_rows(cache(F32, 1).view(torch.uint8)[:, :, ::2])


# -- shm, in one process ------------------------------------------------------------------


@pytest.fixture
def shm_pair():
    made = []

    def make(layout: KVLayout = F32, num_slots: int = 1024):
        d, p = create_transport("shm", num_slots=num_slots), create_transport("shm")
        made.extend([p, d])
        d_cache = d.allocate_cache(layout, NUM_BLOCKS)
        d_cache.view(torch.uint8).view(-1).copy_(seeded_bytes(layout, NUM_BLOCKS, 2))
        p_cache = p.allocate_cache(layout, NUM_BLOCKS)
        p_cache.view(torch.uint8).view(-1).copy_(seeded_bytes(layout, NUM_BLOCKS, 1))
        return p, d, p.connect(d.endpoint()), p_cache, d_cache

    yield make
    for t in made:
        t.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda la: la.dtype)
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
@pytest.mark.parametrize("expect_first", [True, False], ids=["inline", "background"])
def test_shm_send_lands_exactly(shm_pair, layout, structure, expect_first):
    p, d, peer, p_cache, d_cache = shm_pair(layout)
    assert (p._copiers[peer] is None) == (cpu_native.load("kv_block_copy") is None)  # native when built
    src_ids, dst_ids = STRUCTURES[structure]
    want = expected(d_cache, dst_ids, p_cache, src_ids)
    if expect_first:
        hr = d.expect("x", dst_ids, 10.0)
        hs = p.send(peer, src_ids, dst_ids, "x", 10.0)
        # The receiver was ready, so the copy happened inside send().
        assert p.poll(hs) == TransferStatus.SUCCESS
    else:
        hs = p.send(peer, src_ids, dst_ids, "x", 10.0)
        hr = d.expect("x", dst_ids, 10.0)
    assert p.wait(hs).ok and d.wait(hr).ok
    assert torch.equal(d_cache.view(torch.uint8), want)


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_shm_send_without_native_kernels_lands_exactly(shm_pair, native_kernels_off, structure):
    # Connecting with native kernels off leaves the numpy copy per run of ids.
    p, d, peer, p_cache, d_cache = shm_pair(LAYOUTS[1])
    assert p._copiers[peer] is None
    src_ids, dst_ids = STRUCTURES[structure]
    want = expected(d_cache, dst_ids, p_cache, src_ids)
    hr = d.expect("x", dst_ids, 10.0)
    assert p.wait(p.send(peer, src_ids, dst_ids, "x", 10.0)).ok and d.wait(hr).ok
    assert torch.equal(d_cache.view(torch.uint8), want)


def _ids_with_home(num_slots: int, home: int, count: int, prefix: str) -> list[str]:
    found = []
    i = 0
    while len(found) < count:
        tid = f"{prefix}-{i}"
        if transfer_key(tid) % num_slots == home:
            found.append(tid)
        i += 1
    return found


def test_shm_slots_whose_home_is_taken_are_still_found(shm_pair):
    p, d, peer, p_cache, d_cache = shm_pair(num_slots=4)
    # Three transfers hashed to the same home slot: two of them live elsewhere in the table.
    tids = _ids_with_home(4, 1, 3, "collide")
    plan = {tid: ([i], [10 + i]) for i, tid in enumerate(tids)}
    want = expected(d_cache, [10, 11, 12], p_cache, [0, 1, 2])
    handles = [d.expect(tid, dst, 10.0) for tid, (_, dst) in plan.items()]
    for tid, (src, dst) in reversed(plan.items()):
        assert p.wait(p.send(peer, src, dst, tid, 10.0)).ok
    assert all(d.wait(h).ok for h in handles)
    assert torch.equal(d_cache.view(torch.uint8), want)
    # Finished slots are reclaimed: many more transfers than slots go through.
    for i in range(12):
        hr = d.expect(f"more-{i}", [i], 10.0)
        assert p.wait(p.send(peer, [i], [i], f"more-{i}", 10.0)).ok and d.wait(hr).ok


def test_shm_transfer_id_reused_after_success(shm_pair):
    p, d, peer, p_cache, d_cache = shm_pair(num_slots=8)
    for src, dst in (([1, 2], [3, 4]), ([5], [9])):
        hr = d.expect("again", dst, 10.0)
        assert p.wait(p.send(peer, src, dst, "again", 10.0)).ok and d.wait(hr).ok
    want = expected(d_cache, [3, 4, 9], p_cache, [1, 2, 5])
    assert torch.equal(d_cache.view(torch.uint8), want)


def test_shm_receiver_abort_racing_a_send_is_all_or_nothing(shm_pair):
    """abort() on the receiver while the sender copies: either the whole transfer landed
    before the abort (both sides SUCCESS) or none of it lands, not even after abort()
    returned (both sides ABORTED)."""
    layout = KVLayout(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32"
    )  # 64 KiB blocks, so a copy takes a while
    p, d, peer, p_cache, d_cache = shm_pair(layout)
    src_ids, dst_ids = list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS))[::-1]
    seed = cache(layout, 2).view(torch.uint8)
    landed = expected(d_cache, dst_ids, p_cache, src_ids)
    outcomes = []
    for i in range(40):
        d_cache.view(torch.uint8).copy_(seed)
        tid = f"race-{i}"
        hr = d.expect(tid, dst_ids, 10.0)
        go = threading.Barrier(2)
        sent = {}

        def sender(go=go, sent=sent, tid=tid):  # joined in this iteration: the defaults bind its values explicitly
            go.wait()
            sent["handle"] = p.send(peer, src_ids, dst_ids, tid, 10.0)

        thread = threading.Thread(target=sender)
        thread.start()
        go.wait()
        if i % 2:
            threading.Event().wait(random.Random(i).uniform(0, 2e-4))
        d.abort(tid)
        after_abort = d_cache.view(torch.uint8).clone()
        recv_status = d.poll(hr)
        thread.join()
        send_result = p.wait(sent["handle"])
        assert recv_status in (TransferStatus.SUCCESS, TransferStatus.ABORTED)
        assert send_result.status == recv_status, (send_result, recv_status)
        if recv_status == TransferStatus.SUCCESS:
            assert torch.equal(after_abort, landed)
        else:
            assert torch.equal(after_abort, seed)
            assert torch.equal(d_cache.view(torch.uint8), seed)  # nothing written later
        outcomes.append(recv_status)
    assert len(outcomes) == 40  # which outcomes occur depends on scheduling
