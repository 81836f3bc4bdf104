"""The KV transport per pair of workers (kvtransfer.pairwise): the backend is chosen from both
workers' places, and the blocks arrive bit-exact whichever backend carries them.

Two PairwiseTransports in this process stand for a prefill and a decode worker; a different
node id makes them "different nodes" (gloo over 127.0.0.1), the same node id "one node"
(shared memory). The expected bytes are recomputed from the seeds, block by block.
"""

from __future__ import annotations

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
    PairwiseTransport,
    Place,
    TransferStatus,
    offered_kinds,
    pair_kind,
)
from testkit.kvtransfer import seeded_bytes

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
NUM_BLOCKS = 16
A, B = Place("node-a"), Place("node-b")


def test_rule_same_node_shm_different_nodes_gloo_gpu_nccl():
    assert pair_kind("auto", A, A) == "shm"
    assert pair_kind("auto", A, B) == "gloo"
    assert pair_kind("cpu", A, B) == "gloo"
    gpu_a, gpu_b = Place("node-a", device="cuda"), Place("node-b", device="cuda")
    assert pair_kind("auto", gpu_a, gpu_a) == pair_kind("auto", gpu_a, gpu_b) == "nccl"
    assert offered_kinds("auto", A) == ("shm", "gloo") and offered_kinds("auto", gpu_a) == ("nccl",)
    # An explicit choice is an override for every pair.
    assert pair_kind("gloo", A, A) == "gloo" and offered_kinds("gloo", A) == ("gloo",)
    with pytest.raises(KVTransferError, match="shm works inside one node.*node-a.*node-b"):
        pair_kind("shm", A, B)
    with pytest.raises(KVTransferError, match="same device"):
        pair_kind("auto", A, gpu_b)
    with pytest.raises(ValueError, match="needs the workers' KV caches on the CPU"):
        offered_kinds("cpu", gpu_a)
    with pytest.raises(ValueError, match="unknown KV transport choice"):
        offered_kinds("pigeon", A)


def make(place: Place, name: str, seed: int, choice: str = "auto") -> tuple[PairwiseTransport, torch.Tensor]:
    t = PairwiseTransport(choice, place, name)
    cache = t.allocate_cache(LAYOUT, NUM_BLOCKS)
    cache.view(torch.uint8).view(-1).copy_(seeded_bytes(LAYOUT, NUM_BLOCKS, seed))
    return t, cache


@pytest.fixture
def pair(request):
    made = []

    def build(sender: Place, receiver: Place, choice: str = "auto"):
        p, p_cache = make(sender, "prefill-0", 1, choice)
        d, d_cache = make(receiver, "decode-0", 2, choice)
        made.extend([p, d])
        return p, d, d_cache

    yield build
    for t in made:
        t.close()


def expected(src_ids, dst_ids) -> torch.Tensor:
    src = seeded_bytes(LAYOUT, NUM_BLOCKS, 1).view(LAYOUT.num_layers, 2, NUM_BLOCKS, -1)
    dst = seeded_bytes(LAYOUT, NUM_BLOCKS, 2).view(LAYOUT.num_layers, 2, NUM_BLOCKS, -1).clone()
    for s, d in zip(src_ids, dst_ids):
        dst[:, :, d] = src[:, :, s]
    return dst


@pytest.mark.parametrize("receiver, kind", [(A, "shm"), (B, "gloo")], ids=["same-node", "cross-node"])
def test_blocks_arrive_bit_exact_over_the_chosen_backend(pair, receiver, kind):
    p, d, d_cache = pair(A, receiver)
    endpoint = pickle.loads(pickle.dumps(d.endpoint()))  # as Ray hands it over
    assert set(endpoint.address["offers"]) == {"shm", "gloo"}
    peer = p.connect(endpoint)
    assert p.connect(endpoint) == peer  # idempotent
    src, dst = [3, 4, 5, 9, 0], [10, 11, 12, 1, 7]
    for i in range(2):  # twice: the second transfer reuses the pair
        h = d.expect(f"r{i}", dst, 10.0)
        sent = p.wait(p.send(peer, src, dst, f"r{i}", 10.0))
        got = d.wait(h)
        assert sent.ok and got.ok, (sent, got)
    assert torch.equal(d_cache.view(torch.uint8).view(LAYOUT.num_layers, 2, NUM_BLOCKS, -1), expected(src, dst))
    [link] = p.links()
    assert (link.peer, link.peer_node_id, link.kind) == ("decode-0", receiver.node_id, kind)
    assert link.blocks_sent == 2 * len(src) and link.bytes_sent == 2 * len(src) * LAYOUT.block_bytes


def test_receiver_abort_and_deadline_end_every_backend(pair):
    p, d, d_cache = pair(A, B)
    peer = p.connect(d.endpoint())
    before = d_cache.view(torch.uint8).clone()
    h = d.expect("gone", [1, 2], 10.0)
    d.abort("gone")
    assert d.poll(h) == TransferStatus.ABORTED
    assert not p.wait(p.send(peer, [0, 1], [1, 2], "gone", 5.0)).ok
    assert torch.equal(d_cache.view(torch.uint8), before)  # the aborted blocks stayed untouched
    started = time.monotonic()
    late = d.expect("late", [3], 0.3)
    result = d.wait(late)
    assert result.status == TransferStatus.FAILED and time.monotonic() - started < 5
    assert [link.blocks_sent for link in p.links()] == [0]


def test_wrong_destination_fails_fast_not_at_the_deadline(pair):
    p, d, _ = pair(A, B)
    peer = p.connect(d.endpoint())
    h = d.expect("r", [1, 2], 20.0)
    started = time.monotonic()
    assert not p.wait(p.send(peer, [0, 1], [2, 1], "r", 20.0)).ok
    result = d.wait(h)
    assert result.status == TransferStatus.FAILED and "gloo" in result.error
    assert time.monotonic() - started < 10


def test_handshake_refuses_layout_mismatch_and_shm_across_nodes(pair):
    p, d, _ = pair(A, B, choice="shm")
    with pytest.raises(KVTransferError, match="shm works inside one node"):
        p.connect(d.endpoint())
    other = PairwiseTransport("auto", B, "decode-9")
    try:
        other.allocate_cache(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=8, dtype="float32"), 4)
        mine = PairwiseTransport("auto", A, "prefill-9")
        mine.allocate_cache(LAYOUT, 4)
        with pytest.raises(KVLayoutMismatch, match="block_size"):
            mine.connect(other.endpoint())
        mine.close()
    finally:
        other.close()


def test_endpoint_crosses_the_router_without_torch(pair, tmp_path):
    _, d, _ = pair(A, B)
    blob = tmp_path / "endpoint.pkl"
    blob.write_bytes(pickle.dumps(d.endpoint()))
    script = (
        "import pickle, sys; from common.protocol import KVEndpoint; "
        "ep = pickle.loads(open(sys.argv[1], 'rb').read()); assert type(ep) is KVEndpoint; "
        "assert all(type(e) is KVEndpoint for e in ep.address['offers'].values()); "
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(blob)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_requests_connecting_to_a_new_peer_at_once_share_one_pair(pair):
    """The first requests to a restarted decode worker connect from several call threads at once:
    one pair is built, and a transfer through it arrives whole. (Two gloo pairs built at once to
    one peer deadlocked: the connects never returned, and neither did those requests.)"""
    import queue
    import threading

    p, d, d_cache = pair(A, B)
    endpoint = d.endpoint()
    connected: queue.Queue = queue.Queue()
    for _ in range(4):  # daemon threads: a deadlock fails the test instead of hanging the run
        threading.Thread(target=lambda: connected.put(p.connect(endpoint)), daemon=True).start()
    peers = [connected.get(timeout=30) for _ in range(4)]
    assert len(set(peers)) == 1 and len(p.links()) == 1
    h = d.expect("r", [5], 10.0)
    assert p.wait(p.send(peers[0], [2], [5], "r", 10.0)).ok and d.wait(h).ok
    assert torch.equal(d_cache.view(torch.uint8).view(LAYOUT.num_layers, 2, NUM_BLOCKS, -1), expected([2], [5]))
