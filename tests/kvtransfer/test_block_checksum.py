"""kernels.block_checksum: every implementation equals the numpy reference bit for bit.

The reference (`sums_of_rows`) is checked against a hand computation; the native sums, the
native copy that sums as it copies (and its count of landed chunks, which a receiver reads while
the copy runs), and the Triton kernel (run by the Triton interpreter on CPU
tensors, in a child process, since TRITON_INTERPRET must be set before Triton is imported) are
checked against the reference on layouts with whole and partial 8-byte words and 1-, 2- and
4-byte dtypes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.block_checksum import BlockSummer, SummingCopier, block_sums_reference, native_available, sums_of_rows

REPO = Path(__file__).resolve().parents[2]
SHAPES = [  # [L, 2, N, block_size, Hk, D], dtype
    ((2, 2, 7, 2, 1, 4), torch.float32),
    ((3, 2, 9, 3, 1, 5), torch.float8_e4m3fn),  # 15-byte pieces: a partial last word
    ((2, 2, 6, 4, 2, 8), torch.bfloat16),
    ((4, 2, 40, 16, 2, 64), torch.float32),  # 8 KiB pieces: more than one 4 KiB step of the fused copy
]


def random_cache(shape, dtype, seed=0):
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def test_reference_matches_a_hand_computation():
    rows = np.zeros((2, 1, 12), dtype=np.uint8)  # 2 pieces of 12 bytes: words 0,1 | 2,3 (zero-extended tails)
    rows[0, 0, 0] = 3  # word 0 = 3
    rows[0, 0, 8] = 1  # word 1 = 1 (tail)
    rows[1, 0, 0:8] = np.frombuffer((2**64 - 1).to_bytes(8, "little"), dtype=np.uint8)  # word 2 = -1
    s1, s2 = sums_of_rows(rows, [0])[0]
    mod = 2**64
    assert int(s1) == (3 + 1 + (mod - 1)) % mod
    assert int(s2) == (3 * 1 + 1 * 3 + (mod - 1) * 5) % mod


@pytest.mark.skipif(not native_available(torch.zeros(1)), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("shape,dtype", SHAPES)
def test_native_sums_and_summing_copy_equal_the_reference(shape, dtype):
    cache = random_cache(shape, dtype)
    ids = [5, 0, 3, 1]
    want = block_sums_reference(cache, torch.tensor(ids))
    assert np.array_equal(BlockSummer(cache)(array("q", ids)), want)
    dst = torch.zeros_like(cache)
    got = SummingCopier(dst, cache)(array("q", [0, 1, 2, 4]), array("q", ids))
    assert np.array_equal(got, want)
    assert torch.equal(dst.view(torch.uint8)[:, :, [0, 1, 2, 4]], cache.view(torch.uint8)[:, :, ids])
    plain = torch.zeros_like(cache)  # the same copy without the sums (a sender with checksums off)
    assert SummingCopier(plain, cache)(array("q", [0, 1, 2, 4]), array("q", ids), sums=False) is None
    assert torch.equal(plain.view(torch.uint8), dst.view(torch.uint8))
    with pytest.raises(ValueError):
        BlockSummer(cache)(array("q", [shape[2]]))


@pytest.mark.skipif(not native_available(torch.zeros(1)), reason="native CPU kernels unavailable")
def test_summing_copy_publishes_landed_chunks_in_order():
    """With a counter, the copy goes chunk by chunk and counts the blocks landed after each chunk:
    a reader polling the counter from another thread (the copy releases the GIL) only ever sees
    whole chunks, in order, and every block it was told about holds its final bytes."""
    shape, dtype = (4, 2, 600, 16, 2, 64), torch.float32  # 64 KiB blocks
    src = random_cache(shape, dtype, seed=5)
    dst = torch.zeros_like(src)
    n, chunk = 256, 16
    src_ids, dst_ids = list(range(300, 300 + n)), list(range(n))
    landed = np.zeros(1, dtype=np.int64)
    seen, wrong = [], []
    done = threading.Event()
    src_rows, dst_rows = (
        src.view(torch.uint8).numpy().reshape(8, 600, -1),
        dst.view(torch.uint8).numpy().reshape(8, 600, -1),
    )

    def watch():
        checked = 0
        while not done.is_set() or checked < int(landed[0]):
            count = int(landed[0])
            if count > checked:
                seen.append(count)
                if not np.array_equal(dst_rows[:, checked:count], src_rows[:, 300 + checked : 300 + count]):
                    wrong.append(count)
                checked = count

    watcher = threading.Thread(target=watch)
    watcher.start()
    got = SummingCopier(dst, src)(array("q", dst_ids), array("q", src_ids), landed, chunk)
    done.set()
    watcher.join()
    assert int(landed[0]) == n and seen[-1] == n and not wrong
    assert seen == sorted(set(seen)) and all(c % chunk == 0 for c in seen)
    assert np.array_equal(got, block_sums_reference(src, torch.tensor(src_ids)))
    with pytest.raises(ValueError, match="landed"):
        SummingCopier(dst, src)(array("q", [0]), array("q", [1]), np.zeros(1, dtype=np.int32), 1)
    with pytest.raises(ValueError, match="chunk_blocks"):
        SummingCopier(dst, src)(array("q", [0]), array("q", [1]), landed, 0)


@pytest.mark.skipif(not native_available(torch.zeros(1)), reason="native CPU kernels unavailable")
def test_follow_sums_chunks_as_a_concurrent_copy_lands_them():
    """The receiver's native follow (kvtransfer.shm's verifier thread): while a summing copy runs in
    another thread with a counter, one call sums the destination's blocks as they land and returns
    once the copy's state word stops being busy; its sums equal the reference over the source. It
    returns early, with what had landed, when nothing moves (a dead sender) or the state is done."""
    shape, dtype = (4, 2, 600, 16, 2, 64), torch.float32
    src = random_cache(shape, dtype, seed=7)
    dst = torch.zeros_like(src)
    n, chunk, busy, ended = 256, 4, 2, 3
    src_ids, dst_ids = array("q", range(300, 300 + n)), array("q", random.Random(1).sample(range(300), n))
    landed, state = np.zeros(1, dtype=np.int64), np.array([busy], dtype=np.int64)
    out, progress = np.zeros((n, 2), dtype=np.uint64), np.zeros(1, dtype=np.int64)
    summer, result = BlockSummer(dst), {}
    follower = threading.Thread(
        target=lambda: result.setdefault("done", summer.follow(dst_ids, out, progress, landed, state, busy, 5.0))
    )
    want = block_sums_reference(src, torch.tensor(list(src_ids)))
    torn = []  # a count read while the call runs must cover sums already written (another thread lands on it)

    def watch():
        while "done" not in result:
            p = int(progress[0])
            if not np.array_equal(out[:p], want[:p]):
                torn.append(p)

    follower.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    SummingCopier(dst, src)(dst_ids, src_ids, landed, chunk)
    state[0] = ended
    follower.join(timeout=10)
    watcher.join(timeout=10)
    assert result["done"] == n == int(progress[0]) and not torn
    assert np.array_equal(out, want)
    # A copy that stopped half way (its state still busy): the call gives up after max_wait_s.
    landed[0], state[0], out[:], progress[0] = n // 2, busy, 0, 0
    t0 = time.monotonic()
    assert summer.follow(dst_ids, out, progress, landed, state, busy, 0.01) == n // 2 == int(progress[0])
    assert time.monotonic() - t0 < 5.0
    assert np.array_equal(out[: n // 2], block_sums_reference(dst, torch.tensor(list(dst_ids[: n // 2]))))
    assert not out[n // 2 :].any()
    assert summer.follow(dst_ids, out, progress, landed, np.array([ended], dtype=np.int64), busy, 5.0) == n // 2
    with pytest.raises(ValueError, match="done"):
        summer.follow(dst_ids, out, np.array([n + 1], dtype=np.int64), landed, state, busy, 0.0)
    with pytest.raises(ValueError, match="out"):
        summer.follow(dst_ids, out[:1], progress, landed, state, busy, 0.0)
    with pytest.raises(ValueError, match="block ids"):
        summer.follow(array("q", [600] * n), out, np.zeros(1, dtype=np.int64), landed, state, busy, 0.0)


def test_host_wrapper_checks_its_input():
    with pytest.raises(ValueError):
        block_sums_reference(torch.zeros(2, 2, 3), torch.tensor([0]))
    with pytest.raises(ValueError):
        block_sums_reference(torch.zeros(2, 2, 3, 1, 1, 4), torch.tensor([0.0]))


CHILD = """
import numpy as np, torch
from tests.kvtransfer.test_block_checksum import SHAPES, random_cache
from kernels.block_checksum import block_sums_reference, block_sums_triton
for shape, dtype in SHAPES:
    piece = int(np.prod(shape[3:])) * torch.empty((), dtype=dtype).element_size()
    if piece % 8:
        continue  # the kernel reads whole words; block_sums() falls back for such layouts
    cache = random_cache(shape, dtype, seed=3)
    ids = torch.tensor([2, 0, 5])
    got = block_sums_triton(cache, ids, block=64)
    assert np.array_equal(got, block_sums_reference(cache, ids)), (shape, got)
print("TRITON_OK")
"""


def test_triton_kernel_equals_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "TRITON_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
