"""One contract for every KV transport backend available here (inprocess, shm, gloo; nccl
skipped without CUDA). Cross-process backends run between two Ray actors.

Expected cache contents are recomputed in the test process from the seeds, block by block,
independently of the transport's coalescing and packing code."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtransfer import (
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    TransferSide,
    TransferStatus,
    create_transport,
    default_kind,
)
from kvtransfer.shm import sweep_stale_segments
from testkit.kvtransfer import KVWorker, seeded_bytes

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 32
P_SEED, D_SEED = 11, 22
LAYOUTS = {
    "float32": KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"),
    "bfloat16": KVLayout(num_layers=3, num_kv_heads=1, head_dim=16, block_size=2, dtype="bfloat16"),
    "float8_e4m3fn": KVLayout(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype="float8_e4m3fn",
        kv_scales=((0.5, 0.25), (2.0, 1.5)),
    ),
}
F32 = LAYOUTS["float32"]


def view(layout: KVLayout, flat: torch.Tensor) -> torch.Tensor:
    return flat.view(layout.num_layers, 2, NUM_BLOCKS, -1)


def expected_after(layout: KVLayout, src_ids, dst_ids) -> torch.Tensor:
    src = view(layout, seeded_bytes(layout, NUM_BLOCKS, P_SEED))
    dst = view(layout, seeded_bytes(layout, NUM_BLOCKS, D_SEED)).clone()
    for s, d in zip(src_ids, dst_ids):
        dst[:, :, d] = src[:, :, s]
    return dst


def untouched(layout: KVLayout) -> torch.Tensor:
    return view(layout, seeded_bytes(layout, NUM_BLOCKS, D_SEED))


def connect(kind, sides, layout=F32, p_options=None, d_options=None):
    p, d = sides
    endpoint = d.setup(kind, layout, NUM_BLOCKS, D_SEED, d_options)
    p.setup(kind, layout, NUM_BLOCKS, P_SEED, p_options)
    return p, d, p.connect(endpoint)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    diff = (actual != expected).reshape(actual.shape[0], 2, actual.shape[2], -1).any(-1)
    bad = sorted({int(b) for b in diff.nonzero()[:, 2].tolist()})
    assert not bad, f"blocks {bad} differ from the expected bytes"


# -- data movement --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(LAYOUTS))
def test_blocks_arrive_bit_exact_in_noncontiguous_ids(kind, sides, dtype):
    layout = LAYOUTS[dtype]
    p, d, peer = connect(kind, sides, layout)
    # Runs of consecutive ids mixed with scattered ones, both sides, out of order.
    src = [5, 0, 1, 2, 17, 9, 10, 31]
    dst = [30, 3, 4, 5, 11, 0, 1, 20]
    d.expect("req-1", dst, 10.0)
    p.send(peer, src, dst, "req-1", 10.0)
    sent, received = p.wait("req-1", TransferSide.SEND), d.wait("req-1", TransferSide.RECV)
    assert (sent.status, received.status) == (TransferStatus.SUCCESS, TransferStatus.SUCCESS), (sent, received)
    assert sent.nbytes == received.nbytes == len(src) * layout.block_bytes
    assert_bytes_equal(d.cache_bytes(), expected_after(layout, src, dst))
    # The sender keeps its blocks (prefix cache): its cache is unchanged.
    assert_bytes_equal(p.cache_bytes(), view(layout, seeded_bytes(layout, NUM_BLOCKS, P_SEED)))


@pytest.mark.parametrize("kind_", ["gloo"])
def test_gloo_pipelined_chunks_land_in_place(sides_for, kind_):
    """Payload split in chunks of 3 blocks (packed, sent and unpacked one by one)."""
    p, d, peer = connect(kind_, sides_for(kind_), p_options={"chunk_bytes": 3 * F32.block_bytes})
    src = [9, 8, 7, 0, 1, 2, 3, 20, 25, 30, 31]
    dst = [0, 2, 4, 10, 11, 12, 13, 6, 7, 8, 31]
    d.expect("chunked", dst, 10.0)
    p.send(peer, src, dst, "chunked", 10.0)
    assert p.wait("chunked", TransferSide.SEND).status == TransferStatus.SUCCESS
    assert_bytes_equal(d.cache_bytes(), expected_after(F32, src, dst))
    # Payload arriving before expect() is parked whole and unpacked chunk by chunk later.
    p.send(peer, src[:5], [1, 3, 5, 14, 15], "parked", 10.0)
    time.sleep(0.2)
    d.expect("parked", [1, 3, 5, 14, 15], 10.0)
    assert d.wait("parked", TransferSide.RECV).status == TransferStatus.SUCCESS
    assert_bytes_equal(d.cache_bytes(), expected_after(F32, src + src[:5], dst + [1, 3, 5, 14, 15]))


def test_several_transfers_reuse_the_connection(kind, sides):
    p, d, peer = connect(kind, sides)
    plan = [("a", [0, 1], [7, 8]), ("b", [2], [2]), ("c", [3, 4, 5], [12, 14, 13])]
    for tid, _src, dst in plan:
        d.expect(tid, dst, 10.0)
    for tid, src, dst in plan:
        p.send(peer, src, dst, tid, 10.0)
    for tid, _, _ in plan:
        assert p.wait(tid, TransferSide.SEND).status == TransferStatus.SUCCESS
        assert d.wait(tid, TransferSide.RECV).status == TransferStatus.SUCCESS
    src_all = [s for _, src, _ in plan for s in src]
    dst_all = [x for _, _, dst in plan for x in dst]
    assert_bytes_equal(d.cache_bytes(), expected_after(F32, src_all, dst_all))


def test_send_before_expect_completes_when_expect_arrives(kind, sides):
    p, d, peer = connect(kind, sides)
    p.send(peer, [6], [9], "late", 10.0)
    time.sleep(0.2)
    assert p.poll("late", TransferSide.SEND) in (TransferStatus.PENDING, TransferStatus.TRANSFERRING)
    d.expect("late", [9], 10.0)
    assert d.wait("late", TransferSide.RECV).status == TransferStatus.SUCCESS
    assert p.wait("late", TransferSide.SEND).status == TransferStatus.SUCCESS
    assert_bytes_equal(d.cache_bytes(), expected_after(F32, [6], [9]))


def test_zero_block_transfer_succeeds_immediately(kind, sides):
    p, d, peer = connect(kind, sides)
    d.expect("empty", [], 1.0)
    p.send(peer, [], [], "empty", 1.0)
    for side, role in ((p, TransferSide.SEND), (d, TransferSide.RECV)):
        result = side.wait("empty", role, 0.0)
        assert result.status == TransferStatus.SUCCESS and result.nbytes == 0
    assert_bytes_equal(d.cache_bytes(), untouched(F32))


# -- deadlines, aborts, disagreements -------------------------------------------------------


def test_deadline_fails_without_hanging(kind, sides):
    p, d, peer = connect(kind, sides)
    # Sender with nobody expecting, receiver with nobody sending.
    p.send(peer, [1], [1], "nobody-expects", 0.4)
    d.expect("nobody-sends", [2], 0.4)
    # A wait shorter than the deadline returns the current, non-terminal status.
    assert d.wait("nobody-sends", TransferSide.RECV, 0.05).status == TransferStatus.PENDING
    t0 = time.monotonic()
    sent = p.wait("nobody-expects", TransferSide.SEND)
    received = d.wait("nobody-sends", TransferSide.RECV)
    assert time.monotonic() - t0 < 3.0
    assert sent.status == TransferStatus.FAILED and sent.error
    if kind == "shm":  # the sender's error says what it waited for: a receiver's slot that never came
        assert "never" in sent.error, sent.error
    assert received.status == TransferStatus.FAILED and "deadline" in received.error
    assert d.poll("nobody-sends", TransferSide.RECV) == TransferStatus.FAILED
    assert_bytes_equal(d.cache_bytes(), untouched(F32))
    # The connection still works after failures.
    d.expect("after", [3], 10.0)
    p.send(peer, [4], [3], "after", 10.0)
    assert p.wait("after", TransferSide.SEND).status == TransferStatus.SUCCESS
    assert_bytes_equal(d.cache_bytes(), expected_after(F32, [4], [3]))


def test_receiver_abort_protects_its_blocks(kind, sides):
    p, d, peer = connect(kind, sides)
    d.expect("gone", [5, 6], 10.0)
    d.abort("gone")
    assert d.poll("gone", TransferSide.RECV) == TransferStatus.ABORTED
    p.send(peer, [0, 1], [5, 6], "gone", 5.0)
    sent = p.wait("gone", TransferSide.SEND)
    assert sent.status == TransferStatus.ABORTED, sent
    assert "abort" in sent.error
    assert_bytes_equal(d.cache_bytes(), untouched(F32))


def test_sender_abort_is_terminal_at_once(kind, sides):
    p, d, peer = connect(kind, sides)
    p.send(peer, [0], [1], "cancelled", 5.0)  # nobody expects it, so it cannot finish
    p.abort("cancelled")
    t0 = time.monotonic()
    result = p.wait("cancelled", TransferSide.SEND)
    assert result.status == TransferStatus.ABORTED and time.monotonic() - t0 < 1.0
    assert "aborted" in result.error


def test_dst_id_disagreement_fails_both_sides(kind, sides):
    p, d, peer = connect(kind, sides)
    d.expect("mixed", [1, 2], 5.0)
    p.send(peer, [0, 1], [1, 3], "mixed", 5.0)
    sent, received = p.wait("mixed", TransferSide.SEND), d.wait("mixed", TransferSide.RECV)
    assert sent.status == received.status == TransferStatus.FAILED
    assert "dst_block_ids" in sent.error and "dst_block_ids" in received.error
    assert_bytes_equal(d.cache_bytes(), untouched(F32))


def test_bad_arguments_raise_value_errors(kind, sides):
    p, d, peer = connect(kind, sides)
    cases = [
        (lambda: p.send(peer, [0], [NUM_BLOCKS], "x", 1.0), "outside"),
        (lambda: p.send(peer, [-1], [0], "x", 1.0), "outside"),
        (lambda: p.send(peer, [0, 1], [2, 2], "x", 1.0), "duplicate"),
        (lambda: p.send(peer, [0, 1], [2], "x", 1.0), "2 ids"),
        (lambda: p.send(peer, [0], [1], "x", 0.0), "timeout_s"),
        (lambda: p.send("no-such-peer", [0], [1], "x", 1.0), "unknown peer"),
        (lambda: d.expect("", [1], 1.0), "transfer_id"),
        (lambda: d.expect("y", [0, 0], 1.0), "duplicate"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()


# -- handshake ------------------------------------------------------------------------------

MISMATCHES = [
    ("dtype", dict(dtype="float16"), "float32", "float16"),
    ("block_size", dict(block_size=8), "4", "8"),
    ("num_layers", dict(num_layers=3), "2", "3"),
    ("num_kv_heads", dict(num_kv_heads=4), "2", "4"),
    ("head_dim", dict(head_dim=16), "8", "16"),
]


def _with(layout: KVLayout, **changes) -> KVLayout:
    fields = dict(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        kv_scales=layout.kv_scales,
    )
    fields.update(changes)
    return KVLayout(**fields)


@pytest.mark.parametrize("field,change,ours,theirs", MISMATCHES)
def test_handshake_refuses_mismatch(kind, sides, field, change, ours, theirs):
    p, d = sides
    endpoint = d.setup(kind, F32, NUM_BLOCKS, None)
    p.setup(kind, _with(F32, **change), NUM_BLOCKS, None)
    with pytest.raises(KVLayoutMismatch) as info:
        p.connect(endpoint)
    message = str(info.value)
    assert field in message and theirs in message and ours in message, message


def test_handshake_refuses_fp8_scale_mismatch(kind, sides):
    p, d = sides
    fp8 = LAYOUTS["float8_e4m3fn"]
    endpoint = d.setup(kind, fp8, NUM_BLOCKS, None)
    p.setup(kind, _with(fp8, kv_scales=((0.5, 0.25), (2.0, 1.25))), NUM_BLOCKS, None)
    with pytest.raises(KVLayoutMismatch, match=r"kv_scales differ at layer 1.*1\.25"):
        p.connect(endpoint)


def test_gloo_receiver_checks_layout_too():
    """A sender that lies about the peer's layout is still refused by the receiver."""
    d, p = create_transport("gloo"), create_transport("gloo")
    try:
        d.allocate_cache(F32, 4)
        p.allocate_cache(_with(F32, head_dim=16), 4)
        real = d.endpoint()
        forged = type(real)(real.kind, real.worker_id, _with(F32, head_dim=16), real.num_blocks, real.address)
        with pytest.raises(KVLayoutMismatch, match="peer refused.*head_dim"):
            p.connect(forged)
    finally:
        p.close()
        d.close()


# -- backend specifics ----------------------------------------------------------------------


def test_shm_segments_are_unlinked(ray_sides):
    p, d = ray_sides
    paths = []
    for _ in range(2):  # setting up again closes the previous transport
        endpoint = d.setup("shm", F32, NUM_BLOCKS, None)
        paths.append(endpoint.address["path"])
    paths.append(p.setup("shm", F32, NUM_BLOCKS, None).address["path"])
    p.connect(endpoint)
    assert [os.path.exists(path) for path in paths] == [False, True, True]
    for side in (p, d):
        side.close()
    assert not [path for path in paths if os.path.exists(path)]


@pytest.mark.parametrize("fault", ["drop", "fail", "delay"])
def test_inprocess_fault_injection(fault):
    d = create_transport("inprocess")
    p = create_transport("inprocess", fault=fault, fault_delay_s=0.3)
    try:
        d.allocate_cache(F32, 4)
        p.allocate_cache(F32, 4)
        peer = p.connect(d.endpoint())
        t0 = time.monotonic()
        hr = d.expect("f", [1], 1.0)
        hs = p.send(peer, [0], [1], "f", 1.0)
        sent, received = p.wait(hs), d.wait(hr)
        took = time.monotonic() - t0
        if fault == "delay":
            assert sent.status == received.status == TransferStatus.SUCCESS
            assert 0.3 <= took < 1.0
        elif fault == "drop":
            assert sent.status == received.status == TransferStatus.FAILED
            assert "deadline" in sent.error and 1.0 <= took < 2.0
        else:
            assert sent.status == TransferStatus.FAILED and "injected" in sent.error
    finally:
        p.close()
        d.close()


def test_inprocess_fault_argument_is_checked():
    t = create_transport("inprocess", fault="delay:0.25")
    assert (t._fault, t._fault_delay_s) == ("delay", 0.25)
    assert create_transport("inprocess")._fault is None
    with pytest.raises(ValueError, match="unknown KV fault"):
        create_transport("inprocess", fault="explode")


def test_recv_status_by_id_and_unknown_ids():
    d, p = create_transport("inprocess"), create_transport("inprocess")
    try:
        d.allocate_cache(F32, 4)
        p.allocate_cache(F32, 4)
        d.expect("s", [1], 5.0)
        assert d.recv_status("s") == TransferStatus.PENDING
        p.wait(p.send(p.connect(d.endpoint()), [0], [1], "s", 5.0))
        assert d.recv_status("s") == TransferStatus.SUCCESS
        with pytest.raises(ValueError, match="unknown transfer"):
            d.recv_status("never")
        with pytest.raises(ValueError, match="already in progress"):
            d.expect("t", [2], 5.0)
            d.expect("t", [3], 5.0)
    finally:
        p.close()
        d.close()


def test_inprocess_endpoint_cannot_leave_the_process():
    t = create_transport("inprocess")
    t.allocate_cache(F32, 2)
    with pytest.raises(TypeError, match="in-process"):
        pickle.dumps(t.endpoint())
    t.close()


def test_unknown_kind_and_the_default_backend():
    for kind in ("carrier-pigeon", "auto"):  # "auto" is a serving choice (per pair), not a backend
        with pytest.raises(ValueError, match="unknown KV transport"):
            create_transport(kind)
    t = create_transport(default_kind())
    assert t.kind == ("nccl" if torch.cuda.is_available() else "shm")
    t.close()


def test_shm_segment_of_a_killed_process_is_swept(ray_sides):
    """A segment whose owner was killed without close() is unlinked by the next sweep (every
    allocation runs one); live owners' segments are left alone."""
    import ray

    p, _ = ray_sides
    live = p.setup("shm", F32, NUM_BLOCKS, None).address["path"]
    victim = ray.remote(num_cpus=0)(KVWorker).remote()
    path = ray.get(victim.setup.remote("shm", F32, NUM_BLOCKS, None), timeout=60).address["path"]
    ray.kill(victim)
    deadline = time.monotonic() + 20
    swept: list[str] = []
    while path not in swept and time.monotonic() < deadline:
        swept += sweep_stale_segments()
        time.sleep(0.1)
    assert path in swept and not os.path.exists(path) and not os.path.exists(path + ".wake")
    assert os.path.exists(live)


def test_an_owner_that_exits_without_close_leaves_neither_its_segment_nor_its_fifo():
    """Python's resource tracker unlinks both once the owning process has exited (no sweep runs)."""
    owner = (
        "from kvtransfer.shm import ShmTransport; from kvtransfer import KVLayout; t = ShmTransport(); "
        "t.allocate_cache(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype='float32'), 4); "
        "print(t.endpoint().address['path'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", owner],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    if not path.startswith("/dev/shm/"):
        pytest.skip(f"the resource tracker unlinks POSIX shared memory only, not {path}")
    deadline = time.monotonic() + 10  # the tracker process cleans up after its last client is gone
    while (os.path.exists(path) or os.path.exists(path + ".wake")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path) and not os.path.exists(path + ".wake")


def test_a_sender_lets_go_of_a_receiver_whose_process_exited(ray_sides):
    """A send to a receiver that exited (a decode worker restarted or removed) fails at once rather
    than at its deadline, and the next connection unmaps the exited receiver's segment."""
    import ray

    from kvtransfer.shm import ShmTransport

    sender = ShmTransport()
    sender.allocate_cache(F32, NUM_BLOCKS)
    victim = ray.remote(num_cpus=0)(KVWorker).remote()
    gone = ray.get(victim.setup.remote("shm", F32, NUM_BLOCKS, None), timeout=60)
    pid = ray.get(victim.pid.remote(), timeout=60)
    peer = sender.connect(gone)
    ray.kill(victim)
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        sent = sender.wait(sender.send(peer, [1], [1], "to-an-exited-receiver", 30.0), timeout_s=10.0)
        assert sent.status == TransferStatus.FAILED and "has exited" in sent.error, sent
        live = ray_sides[1].setup("shm", F32, NUM_BLOCKS, D_SEED)
        sender.connect(live)
        assert sender.peers() == [live.worker_id]
        with open("/proc/self/maps") as maps:  # its mapping went with the last reference to it
            assert gone.address["path"] not in maps.read()
    finally:
        sender.close()


def test_shm_registered_cache_can_send_but_not_receive():
    d, p = create_transport("shm"), create_transport("shm")
    try:
        d.allocate_cache(F32, 4)
        private = torch.zeros(F32.cache_shape(4), dtype=torch.float32)
        private[:, :, 2] = 7.0
        p.register_cache(private, F32)
        with pytest.raises(ValueError, match="cannot receive"):
            p.expect("x", [0], 1.0)
        with pytest.raises(ValueError, match="private cache"):
            d.connect(p.endpoint())
        peer = p.connect(d.endpoint())
        hr = d.expect("x", [1], 5.0)
        assert p.wait(p.send(peer, [2], [1], "x", 5.0)).ok and d.wait(hr).ok
        assert torch.equal(d._cache[:, :, 1], private[:, :, 2])
    finally:
        p.close()
        d.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_needs_cuda():
    with pytest.raises(KVTransferError, match="needs CUDA"):
        create_transport("nccl")


def test_a_segment_is_faulted_in_behind_the_worker_without_changing_what_it_holds(tmp_path):
    """fault_in_background maps every page of a fresh segment (its resident size grows to the whole
    segment, counted by the kernel in /proc/self/smaps) and leaves the bytes written before it
    ran as they were."""
    import mmap

    from kvtransfer._segment import PAGE, fault_in_background

    size = 64 << 20
    path = tmp_path / "segment"
    with open(path, "wb") as f:
        f.truncate(size)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    written = torch.randint(1, 256, (3 * PAGE + 5,), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    raw[PAGE : PAGE + written.numel()] = written  # a peer's copy that landed before the thread runs

    def resident_kib() -> int:
        start = f"{raw.data_ptr():x}-"
        with open("/proc/self/smaps") as smaps:
            lines = iter(smaps)
            for line in lines:
                if line.startswith(start):
                    return next(int(rss.split()[1]) for rss in lines if rss.startswith("Rss:"))
        raise AssertionError("mapping not in /proc/self/smaps")

    assert resident_kib() <= 4 * PAGE // 1024 + 4  # only the written pages so far
    fault_in_background(raw).join(timeout=60)
    assert resident_kib() == size // 1024
    assert torch.equal(raw[PAGE : PAGE + written.numel()], written)
    assert int(raw[:PAGE].max()) == 0 and int(raw[PAGE + written.numel() :].max()) == 0
