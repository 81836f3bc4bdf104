"""What verifying a shared-memory KV handoff would cost with sums taken earlier or pulled blocks (a design study).

Today's shm transport (kvtransfer/shm.py) pushes: the sender copies its blocks into the receiver's
cache and sums them on the way, and the receiver reads every block it got once more to verify the
sums (overlapping the copy, kvtransfer/_follower.py). On a 2-core host that second read competes
with the copy for memory, and `bench.kv_transfer --checksum-cost` measures the check at 25-45% of
the transfer time. This study times, between two processes on 16 MiB of scattered blocks, the
handoffs two other designs would make (sums taken where the KV is written; a receiver that pulls):

  push_copy       the sender copies, no sums (today's handoff with checksums off)
  push_verified   the sender copies and sums, the receiver sums what landed (today's, checksums on)
  push_sealed     the sender copies without sums, the receiver sums what landed: today's push with
                  the sender's sums taken when the KV was written (a cost not counted here)
  pull_copy       the receiver copies from the sender's cache, no sums
  pull_verified   the receiver copies and sums in registers (it reads nothing twice) while the
                  sender sums its own source blocks: the expected sums
  pull_sealed     the receiver copies and sums; the sender does nothing (its sums taken when the
                  KV was written, a cost not counted here)

Each handoff is timed from the start signal until both sides are done; the variants take turns,
repetition by repetition. Run:

    .venv/bin/python -m bench.kv_checksum_pull   # -> bench/results/kv_checksum_pull.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from array import array
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from cluster.busy_host import cpu_name
from common.stats import percentile, percentiles
from kernels.block_checksum import BlockSummer, SummingCopier

# What each handoff does (the docstring says why); the JSON carries these so its table explains itself.
VARIANTS = {
    "push_copy": "the sender copies, no sums",
    "push_verified": "the sender copies and sums; the receiver sums what landed",
    "push_sealed": "the sender copies, no sums; the receiver sums what landed (sender's sums taken earlier)",
    "pull_copy": "the receiver copies, no sums",
    "pull_verified": "the receiver copies and sums; the sender sums its source meanwhile",
    "pull_sealed": "the receiver copies and sums (sender's sums taken earlier)",
}
NAMES = tuple(VARIANTS)  # index = the VARIANT control word
CACHE_SHAPE_TAIL = (16, 2, 64)  # block_size, kv heads, head_dim (float32): 64 KiB blocks over 4 layers
NUM_LAYERS = 4
CHUNK_BLOCKS = 4  # the push copy's landed counter moves every 256 KiB, as the transport's default
# Control words (int64) in a small shared file: the repetition to run, its variant, the push copy's
# landed count and state, and the receiver's end time and last repetition done.
GO, VARIANT, LANDED, STATE, RECEIVER_END, RECEIVER_DONE = 0, 1, 8, 9, 16, 17
BUSY, ENDED = 1, 2


def cache(path: str, num_blocks: int) -> torch.Tensor:
    return torch.from_numpy(
        np.memmap(path, dtype=np.float32, mode="r+", shape=(NUM_LAYERS, 2, num_blocks, *CACHE_SHAPE_TAIL))
    )


def block_ids(num_blocks: int, n: int, seed: int) -> array:
    return array("q", np.random.default_rng(seed).permutation(num_blocks)[:n].tolist())


class Side:
    """One process's view: the sender's cache (src), the receiver's (dst), the control words."""

    def __init__(self, folder: str, num_blocks: int, n: int) -> None:
        self.src, self.dst = cache(f"{folder}/src", num_blocks), cache(f"{folder}/dst", num_blocks)
        self.control = np.memmap(f"{folder}/control", dtype=np.int64, mode="r+", shape=(64,))
        self.copier = SummingCopier(self.dst, self.src)
        self.src_sums, self.dst_sums = BlockSummer(self.src), BlockSummer(self.dst)
        self.src_ids, self.dst_ids = block_ids(num_blocks, n, 1), block_ids(num_blocks, n, 2)


def receiver(folder: str, num_blocks: int, n: int) -> None:
    side, seen, parent = Side(folder, num_blocks, n), 0, os.getppid()
    c = side.control
    while True:
        spins = 0
        while int(c[GO]) == seen:
            spins += 1
            if spins % 100_000 == 0 and os.getppid() != parent:
                return  # the sender is gone: spin no longer
        seen = int(c[GO])
        if seen < 0:
            return
        variant = NAMES[int(c[VARIANT])]
        if variant in ("push_verified", "push_sealed"):
            sums, done = np.empty((n, 2), np.uint64), np.zeros(1, np.int64)
            side.dst_sums.follow(side.dst_ids, sums, done, c[LANDED : LANDED + 1], c[STATE : STATE + 1], BUSY, 1.0)
        elif variant == "pull_copy":
            side.copier(side.dst_ids, side.src_ids, sums=False)
        elif variant in ("pull_verified", "pull_sealed"):
            side.copier(side.dst_ids, side.src_ids)
        c[RECEIVER_END] = time.monotonic_ns()
        c[RECEIVER_DONE] = seen


def sender(side: Side, reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant: the handoffs' seconds (until both sides are done) and the sender's own."""
    c = side.control
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    own: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(1, reps * len(VARIANTS) + 1):
        # Rotate the order each round, so that no variant always follows the same one.
        variant = NAMES[(rep - 1 + (rep - 1) // len(VARIANTS)) % len(VARIANTS)]
        c[VARIANT], c[LANDED], c[STATE] = NAMES.index(variant), 0, BUSY
        start = time.monotonic_ns()
        c[GO] = rep
        if variant == "push_copy":
            side.copier(side.dst_ids, side.src_ids, sums=False)
        elif variant == "push_verified":
            side.copier(side.dst_ids, side.src_ids, c[LANDED : LANDED + 1], CHUNK_BLOCKS)
        elif variant == "push_sealed":
            side.copier(side.dst_ids, side.src_ids, c[LANDED : LANDED + 1], CHUNK_BLOCKS, sums=False)
        elif variant == "pull_verified":
            side.src_sums(side.src_ids)
        mine = time.monotonic_ns()
        c[STATE] = ENDED
        deadline = time.monotonic() + 30.0
        while int(c[RECEIVER_DONE]) != rep:
            if time.monotonic() > deadline:
                raise RuntimeError("the receiver process stopped answering")
        times[variant].append((max(mine, int(c[RECEIVER_END])) - start) / 1e9)
        own[variant].append((mine - start) / 1e9)
        time.sleep(0.005)
    return times, own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=80)
    p.add_argument("--mib", type=int, default=16, help="handoff size")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_checksum_pull.json"))
    p.add_argument("--receiver", nargs=3, metavar=("FOLDER", "NUM_BLOCKS", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.receiver:
        receiver(args.receiver[0], int(args.receiver[1]), int(args.receiver[2]))
        return
    block_bytes = NUM_LAYERS * 2 * int(np.prod(CACHE_SHAPE_TAIL)) * 4
    n = (args.mib << 20) // block_bytes
    num_blocks = 4 * n
    for stale in Path("/dev/shm").glob("baton_kv_checksum_pull_*"):  # left by a run that was killed
        if not Path(f"/proc/{stale.name.rsplit('_', 1)[1]}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    folder = f"/dev/shm/baton_kv_checksum_pull_{os.getpid()}"
    os.makedirs(folder)
    child = None
    try:
        for name, size in (("src", num_blocks * block_bytes), ("dst", num_blocks * block_bytes), ("control", 512)):
            with open(f"{folder}/{name}", "wb") as f:
                f.truncate(size)
        side = Side(folder, num_blocks, n)
        side.src.copy_(torch.randn(side.src.shape))
        side.dst.fill_(1.0)  # both caches' pages touched before the first copy
        load_before = os.getloadavg()
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.kv_checksum_pull", "--receiver", folder, str(num_blocks), str(n)],
            cwd=Path(__file__).resolve().parents[1],
        )
        time.sleep(3.0)  # the receiver imports and maps the caches
        times, own = sender(side, args.reps)
        side.control[GO] = -1
        child.wait(timeout=30)
        child = None
        # The pull copy landed the right bytes, and the sums of both sides agree.
        assert torch.equal(side.dst[:, :, list(side.dst_ids)], side.src[:, :, list(side.src_ids)])
        assert np.array_equal(side.src_sums(side.src_ids), side.dst_sums(side.dst_ids))
    finally:
        if child is not None:
            child.kill()
        for name in ("src", "dst", "control"):
            Path(f"{folder}/{name}").unlink(missing_ok=True)
        os.rmdir(folder)
    median = {v: percentile(t, 50) for v, t in times.items()}
    copy = min(median["push_copy"], median["pull_copy"])
    result = {
        "benchmark": "kv_checksum_pull",
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": ".venv/bin/python -m bench.kv_checksum_pull" + (f" --reps {args.reps}" if args.reps != 80 else ""),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_name(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "note": "2 cores shared with other developers' jobs: expect noise",
        },
        "bytes": n * block_bytes,
        "blocks": n,
        "block_bytes": block_bytes,
        "block_ids": "scattered",
        "reps": args.reps,
        "variants": VARIANTS,
        "seconds_median": median,
        "seconds_quartiles": {v: percentiles(t, [25, 75]) for v, t in times.items()},
        # the push variants' copy alone (the receiver's check of a push competes with it for memory)
        "sender_seconds_median": {v: percentile(own[v], 50) for v in VARIANTS if v.startswith("push")},
        "overhead": {
            "push_verified_over_push_copy": median["push_verified"] / median["push_copy"] - 1,
            "push_sealed_over_push_copy": median["push_sealed"] / median["push_copy"] - 1,
            "pull_verified_over_fastest_copy": median["pull_verified"] / copy - 1,
            "pull_sealed_over_fastest_copy": median["pull_sealed"] / copy - 1,
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("seconds_median", "overhead")}, indent=1))


if __name__ == "__main__":
    main()
