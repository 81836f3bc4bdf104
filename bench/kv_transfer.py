"""KV transfer throughput between a prefill actor and a decode actor (two Ray actors on
127.0.0.1), for each cross-process CPU backend, against a plain in-process memcpy of the same
number of bytes in the same actor (the machine's limit).

    .venv/bin/python -m bench.kv_transfer [--reps 7] [--out bench/results/kv_transfer.json]
    # quicker, for development (prints only unless --out is given):
    .venv/bin/python -m bench.kv_transfer --backends shm --blocks 16 64 --out ''

Then the same measurements as serving workers make them, with the transport per pair of workers
(`kvtransfer.PairwiseTransport`, backend chosen from the two actors' Ray nodes) on a Ray
cluster of two simulated nodes on this machine (`testkit.cluster.FakeCluster`): a decode actor
on the prefill actor's node (auto picks shared memory) and one on the other node (auto picks
gloo, over loopback here: what crossing nodes costs in CPU and protocol, without a real
network's bandwidth). `--no-cross-node` skips this part.

A transfer is timed inside the prefill actor from `send()` to a terminal result; the decode
actor has already called `expect()`. For gloo that includes the receiver's unpack and its
verdict coming back; for shm the copy lands directly in the decode actor's cache.

Two modes: "isolated" (one transfer per Ray call, so each starts in an actor process that was
just woken up) and "back-to-back" (all repetitions in one actor call, as when a prefill
worker ships several requests in a row). Block ids move every repetition and the memcpy
baseline rotates through 256 MiB, so neither finds its data in the CPU caches; a hot-cache
memcpy is recorded alongside. Sizes go from one 64 KiB block to 1024 blocks (64 MiB), with
block ids either one contiguous run or scattered (one run per block).

`--checksum-cost` measures only what end-to-end integrity costs (kvtransfer.integrity) on a
clean 16 MiB handoff over shared memory, checksums off and on side by side (two prefill actors,
one of each, alternating repetition by repetition, so that the load of a shared machine hits
both alike, into one decode actor):

    .venv/bin/python -m bench.kv_transfer --checksum-cost   # -> bench/results/kv_transfer_checksum.json

per transfer (101 repetitions of each by default): the sender's time (send() to terminal: the
copy, and with checksums the sums taken inside it and the seals written) and the handoff: from
send() until the receiver holds verified blocks. Both senders run the same native copy, with and
without its sums (kvtransfer/shm.py), so that the two differ by what checksums add. Without
checksums the handoff is the sender's time (the blocks are there when the copy ends; the
receiver's own look is not counted); with them it ends when the receiver's record turned SUCCESS
(CLOCK_MONOTONIC, which both processes share), its verifier thread having summed the chunks while
they were copied (kvtransfer/_follower.py). `receiver_after_copy` is how long that was
after the copy ended. It also records, in one process, the native sum against zlib.crc32 on hot
buffers, and kernels.block_copy's copy, the summing copy without and with its sums and the sums
alone with block ids moving as in the handoffs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import time
import zlib
from array import array

REPO = pathlib.Path(__file__).resolve().parents[1]
from common.envs import ensure_private_ray_env

ensure_private_ray_env()

import ray
import torch

from kernels.block_checksum import BlockSummer, SummingCopier
from kernels.block_copy import KVBlockCopier
from kvtransfer import KVLayout, Place, TransferSide
from testkit.cluster import FakeCluster, NodeType
from testkit.kvtransfer import KVWorker

# 4 layers x K/V x 16 tokens x 2 KV heads x 64 dims x fp32 = 64 KiB per block.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
BLOCK_COUNTS = [1, 4, 16, 64, 256, 1024]
NUM_BLOCKS = 1024 + 64
BACKENDS = ["shm", "gloo"]
MODES = ("isolated", "back_to_back")
PATTERNS = ("contiguous", "scattered")


class BenchWorker(KVWorker):
    def __init__(self) -> None:
        super().__init__()
        self.expected_at: dict[str, float] = {}

    def memcpy_bytes_per_s(self, nbytes: int, reps: int, cold: bool) -> float:
        """Median bytes/s of `dst.copy_(src)`. Cold: src/dst rotate through 256 MiB pools so
        no copy finds its data in the CPU caches (the DRAM limit); hot: the same buffers."""
        pool = max(nbytes, 256 << 20) if cold else nbytes
        src = torch.randint(0, 256, (pool,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in
        slots = pool // nbytes
        times = []
        for rep in range(reps):
            off = (rep % slots) * nbytes
            t0 = time.perf_counter()
            dst[off : off + nbytes].copy_(src[off : off + nbytes])
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times)

    def threads(self) -> int:
        return torch.get_num_threads()

    def verified_at(self, transfer_id: str) -> tuple[float, bool]:
        """When (time.monotonic(), system-wide) the receiver's record of `transfer_id` turned
        terminal, and whether it is SUCCESS."""
        result = self.wait(transfer_id, TransferSide.RECV, 10.0)
        # result.seconds runs from the record's start, a few microseconds after expected_at.
        return self.expected_at.pop(transfer_id) + result.seconds, result.ok

    def timed_send(self, peer: str, plan: tuple) -> tuple[float, float]:
        """One transfer: (time.monotonic() at send(), seconds from send() to terminal here)."""
        tid, src, dst = plan
        start = time.monotonic()
        result, seconds = self.send_and_wait(peer, src, dst, tid, 60.0)
        assert result.ok, result
        return start, seconds

    def sum_costs(self, nbytes: int, reps: int) -> dict:
        """Hot-buffer bytes/s of the native block sums, zlib.crc32, the native copy and the
        native copy that sums as it copies, on `nbytes` of this actor's cache."""
        cache = self.cache.view(torch.uint8)
        n = nbytes // LAYOUT.block_bytes
        src, dst = array("q", range(n)), array("q", range(n, 2 * n))
        packed = cache[:, :, :n].contiguous().numpy()
        copier, summing, summer = KVBlockCopier(cache, cache), SummingCopier(cache, cache), BlockSummer(cache)
        fns = {
            "block_sums": lambda: summer(src),
            "zlib_crc32": lambda: zlib.crc32(packed),
            "copy": lambda: copier(dst, src),
            "copy_and_sums": lambda: summing(dst, src),
        }
        out = {}
        for name, fn in fns.items():
            fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[f"{name}_bytes_per_s"] = nbytes / statistics.median(times)
        return out

    def cold_costs(self, n: int, reps: int) -> dict:
        """Per block-id pattern, median seconds of kernels.block_copy's copy, the summing copy
        without its sums (what a checksums-off shm sender runs), the summing copy, and the native
        sums alone (what the receiver's check reads) over n blocks of this actor's cache, ids
        moving every repetition as in the handoffs (so mostly from memory), the four alternating."""
        cache = self.cache.view(torch.uint8)
        copier, summing, summer = KVBlockCopier(cache, cache), SummingCopier(cache, cache), BlockSummer(cache)
        out = {}
        for pattern in PATTERNS:
            times: dict = {"copy": [], "copy_without_sums": [], "copy_and_sums": [], "block_sums": []}
            for rep in range(reps + 1):
                src = array("q", block_ids(n, pattern, rep, 0))
                dst = array("q", block_ids(n, pattern, rep, NUM_BLOCKS // 2))
                for name, fn in (  # each called at once, below: the defaults bind this rep's ids explicitly
                    ("copy", lambda dst=dst, src=src: copier(dst, src)),
                    ("copy_without_sums", lambda dst=dst, src=src: summing(dst, src, sums=False)),
                    ("copy_and_sums", lambda dst=dst, src=src: summing(dst, src)),
                    ("block_sums", lambda dst=dst: summer(dst)),
                ):
                    t0 = time.perf_counter()
                    fn()
                    if rep:
                        times[name].append(time.perf_counter() - t0)
            out[pattern] = {f"{name}_seconds_median": statistics.median(t) for name, t in times.items()}
        return out

    def expect_batch(self, plans: list) -> None:
        for tid, _, dst in plans:
            self.expected_at[tid] = time.monotonic()
            self.expect(tid, dst, 60.0)

    def send_batch(self, peer: str, plans: list) -> list[float]:
        """Transfers one after the other inside this actor, each timed on its own."""
        out = []
        for tid, src, dst in plans:
            result, seconds = self.send_and_wait(peer, src, dst, tid, 60.0)
            assert result.ok, result
            out.append(seconds)
        return out

    def all_received(self, plans: list) -> bool:
        return all(self.wait(tid, TransferSide.RECV, 10.0).ok for tid, _, _ in plans)

    def setup_pairwise(self, name: str, seed: int):
        """A serving worker's transport: the backend per peer from both actors' Ray nodes."""
        ctx = ray.get_runtime_context()
        place = Place(ctx.get_node_id(), ray.util.get_node_ip_address())
        return self.setup("pairwise", LAYOUT, NUM_BLOCKS, seed, {"choice": "auto", "place": place, "name": name})

    def kind_for(self, endpoint) -> str:
        return self.transport.kind_for(endpoint)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def block_ids(n: int, pattern: str, rep: int, offset: int) -> list[int]:
    """Ids for one repetition; they move every repetition so that, like the cold memcpy,
    a transfer does not find its blocks in the CPU caches."""
    if pattern == "scattered":
        return random.Random(rep * 7919 + n + offset).sample(range(NUM_BLOCKS), n)
    start = (rep * n + offset) % (NUM_BLOCKS - n + 1)
    return list(range(start, start + n))


def plans(kind: str, mode: str, n: int, pattern: str, reps: int) -> list:
    """reps + 1 transfers; the first one warms up and is not counted."""
    return [
        (
            f"{kind}-{mode}-{pattern}-{n}-{rep}",
            block_ids(n, pattern, rep, 0),
            block_ids(n, pattern, rep, NUM_BLOCKS // 2),
        )
        for rep in range(reps + 1)
    ]


def measure(p, d, peer: str, kind: str, n: int, pattern: str, reps: int, mode: str) -> float:
    batch = plans(kind, mode, n, pattern, reps)
    if mode == "back_to_back":
        ray.get(d.expect_batch.remote(batch))
        times = ray.get(p.send_batch.remote(peer, batch))
    else:
        times = []
        for plan in batch:
            ray.get(d.expect_batch.remote([plan]))
            times += ray.get(p.send_batch.remote(peer, [plan]))
    assert ray.get(d.all_received.remote(batch))
    return statistics.median(times[1:])


def measure_pairs(args) -> list[dict]:
    """Same-node and cross-node pairs of PairwiseTransports on a two-node fake Ray cluster.
    Runs before the local part: this process cannot connect to a cluster after ray.shutdown()
    of a private Ray (its actors are cancelled), though the other order works."""
    nodes = [NodeType("bench-a", 1, {"CPU": 1, "bench_a": 2}), NodeType("bench-b", 1, {"CPU": 1, "bench_b": 1})]
    rows = []
    with FakeCluster(nodes, head_cpus=1):
        actor = ray.remote(num_cpus=0)(BenchWorker)
        p = actor.options(resources={"bench_a": 1}).remote()
        placements = {
            "same_node": actor.options(resources={"bench_a": 1}).remote(),
            "cross_node": actor.options(resources={"bench_b": 1}).remote(),
        }
        p_node = ray.get(p.node_id.remote())
        memcpy = {
            n: ray.get(p.memcpy_bytes_per_s.remote(n * LAYOUT.block_bytes, max(args.reps, 9), True))
            for n in args.blocks
        }
        for placement, d in placements.items():
            assert (ray.get(d.node_id.remote()) == p_node) == (placement == "same_node")
            endpoint = ray.get(d.setup_pairwise.remote("decode", 1))
            ray.get(p.setup_pairwise.remote("prefill", 2))
            peer = ray.get(p.connect.remote(endpoint))
            kind = ray.get(p.kind_for.remote(endpoint))
            for pattern in args.patterns:
                for n in args.blocks:
                    nbytes = n * LAYOUT.block_bytes
                    row = {
                        "placement": placement,
                        "backend": kind,
                        "block_ids": pattern,
                        "blocks": n,
                        "bytes": nbytes,
                        "memcpy_bytes_per_s": memcpy[n],
                    }
                    for mode in MODES:
                        seconds = measure(p, d, peer, f"{placement}-{kind}", n, pattern, args.reps, mode)
                        row[f"{mode}_seconds_median"] = seconds
                        row[f"{mode}_bytes_per_s"] = nbytes / seconds
                        row[f"{mode}_ratio_to_memcpy"] = nbytes / seconds / memcpy[n]
                    rows.append(row)
            ray.get([p.close.remote(), d.close.remote()])
    return rows


def pair_summary(rows: list[dict]) -> dict:
    big = [r for r in rows if r["bytes"] >= 1 << 20]
    return {
        f"{placement} ({next(r['backend'] for r in big if r['placement'] == placement)})": {
            m: round(statistics.mean(r[f"{m}_ratio_to_memcpy"] for r in big if r["placement"] == placement), 3)
            for m in MODES
        }
        for placement in dict.fromkeys(r["placement"] for r in big)
    }


def measure_local(args) -> tuple[list[dict], int]:
    """Each backend between two actors of a private Ray on 127.0.0.1 (one node)."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
    )
    actor = ray.remote(num_cpus=0)(BenchWorker)
    p, d = actor.remote(), actor.remote()
    rows = []
    try:
        memcpy = {
            (n, cold): ray.get(p.memcpy_bytes_per_s.remote(n * LAYOUT.block_bytes, max(args.reps, 9), cold))
            for n in args.blocks
            for cold in (True, False)
        }
        threads = ray.get(p.threads.remote())
        for kind in args.backends:
            endpoint = ray.get(d.setup.remote(kind, LAYOUT, NUM_BLOCKS, 1))
            ray.get(p.setup.remote(kind, LAYOUT, NUM_BLOCKS, 2))
            peer = ray.get(p.connect.remote(endpoint))
            for pattern in args.patterns:
                for n in args.blocks:
                    nbytes = n * LAYOUT.block_bytes
                    row = {
                        "backend": kind,
                        "block_ids": pattern,
                        "blocks": n,
                        "bytes": nbytes,
                        "memcpy_bytes_per_s": memcpy[n, True],
                        "memcpy_hot_cache_bytes_per_s": memcpy[n, False],
                    }
                    for mode in MODES:
                        seconds = measure(p, d, peer, kind, n, pattern, args.reps, mode)
                        row[f"{mode}_seconds_median"] = seconds
                        row[f"{mode}_bytes_per_s"] = nbytes / seconds
                        row[f"{mode}_ratio_to_memcpy"] = nbytes / seconds / memcpy[n, True]
                    rows.append(row)
            ray.get([p.close.remote(), d.close.remote()])
    finally:
        ray.shutdown()
    return rows, threads


CHECKSUM_BLOCKS = 256  # 16 MiB of 64 KiB blocks
CHECKSUM_REPS = 101  # the machine is shared: medians of many interleaved repetitions


def measure_checksum_cost(args) -> dict:
    """A clean 16 MiB shm handoff with checksums off and on, alternating repetition by
    repetition (one prefill actor each, one decode actor) so that load drift hits both."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
    )
    actor = ray.remote(num_cpus=0)(BenchWorker)
    d, senders = actor.remote(), {False: actor.remote(), True: actor.remote()}
    reps = max(args.reps, CHECKSUM_REPS)
    rows = []
    on_handoffs: dict = {}
    load_before = os.getloadavg()
    try:
        endpoint = ray.get(d.setup.remote("shm", LAYOUT, NUM_BLOCKS, 1))
        peers = {}
        for checksums, p in senders.items():
            ray.get(p.setup.remote("shm", LAYOUT, NUM_BLOCKS, 2, {"checksums": checksums}))
            peers[checksums] = ray.get(p.connect.remote(endpoint))
        costs = ray.get(senders[True].sum_costs.remote(CHECKSUM_BLOCKS * LAYOUT.block_bytes, reps))
        cold = ray.get(senders[True].cold_costs.remote(CHECKSUM_BLOCKS, reps))
        for pattern in args.patterns:
            times = {c: {"send": [], "handoff": [], "after": []} for c in senders}
            for rep in range(reps + 1):  # the first of each is a warm-up
                for checksums, p in senders.items():
                    tid = f"ck-{pattern}-{int(checksums)}-{rep}"
                    plan = (
                        tid,
                        block_ids(CHECKSUM_BLOCKS, pattern, rep, 0),
                        block_ids(CHECKSUM_BLOCKS, pattern, rep, NUM_BLOCKS // 2),
                    )
                    ray.get(d.expect_batch.remote([plan]))
                    time.sleep(0.005)  # the receiver's verifier thread back asleep, as between requests
                    start, send_s = ray.get(p.timed_send.remote(peers[checksums], plan))
                    verified, ok = ray.get(d.verified_at.remote(tid))
                    assert ok, tid
                    handoff = max(verified - start, send_s) if checksums else send_s
                    if rep:
                        times[checksums]["send"].append(send_s)
                        times[checksums]["handoff"].append(handoff)
                        times[checksums]["after"].append(handoff - send_s)
            on_handoffs[pattern] = times[True]["handoff"]
            for checksums, t in times.items():
                rows.append(
                    {
                        "block_ids": pattern,
                        "checksums": checksums,
                        "bytes": CHECKSUM_BLOCKS * LAYOUT.block_bytes,
                        "send_seconds_median": statistics.median(t["send"]),
                        "receiver_after_copy_seconds_median": statistics.median(t["after"]),
                        "handoff_seconds_median": statistics.median(t["handoff"]),
                        # quartiles: on a shared machine the receiver's verifier thread gets a
                        # core of its own (and overlaps the copy) in some repetitions only
                        "handoff_seconds_quartiles": statistics.quantiles(t["handoff"], n=4),
                        "receiver_after_copy_seconds_quartiles": statistics.quantiles(t["after"], n=4),
                    }
                )
    finally:
        # Closed before Ray ends the actors: their shared-memory segments go with them (a killed
        # actor's stay in /dev/shm until the next transport's sweep).
        ray.get([actor.close.remote() for actor in (d, *senders.values())])
        ray.shutdown()
    overhead = {}
    for pattern in args.patterns:
        off, on = (next(r for r in rows if r["block_ids"] == pattern and r["checksums"] == c) for c in (False, True))
        overhead[pattern] = {
            "send": on["send_seconds_median"] / off["send_seconds_median"] - 1,
            "handoff": on["handoff_seconds_median"] / off["handoff_seconds_median"] - 1,
            "handoff_best_quarter": on["handoff_seconds_quartiles"][0] / off["handoff_seconds_quartiles"][0] - 1,
            # the share of repetitions in which checksums added at most 10% to the handoff, against
            # the median handoff without them
            "handoff_within_10pct_share": statistics.mean(
                h <= 1.1 * off["handoff_seconds_median"] for h in on_handoffs[pattern]
            ),
        }
    return {
        "benchmark": "kv_transfer_checksum",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_average_1_5_15": os.getloadavg(),
            "load_average_1_5_15_before": load_before,
            "note": "2 cores shared with other developers' jobs: expect noise",
        },
        "command": ".venv/bin/python -m bench.kv_transfer --checksum-cost",
        "verify_chunk_bytes": 256 << 10,
        "checksums_off_copy": "the summing copy without its sums (SummingCopier(sums=False)): the same loads and "
        "stores, so the two sides differ by the sums and the receiver's check alone",
        "layout": {
            "num_layers": LAYOUT.num_layers,
            "num_kv_heads": LAYOUT.num_kv_heads,
            "head_dim": LAYOUT.head_dim,
            "block_size": LAYOUT.block_size,
            "dtype": LAYOUT.dtype,
            "block_bytes": LAYOUT.block_bytes,
        },
        "reps": reps,
        "results": rows,
        "overhead": overhead,
        "hot_buffer_costs_16MiB": costs,
        "one_process_16MiB": cold,
        "target": "checksums add at most 10% to the transfer time",
    }


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 10}K" if nbytes < 1 << 20 else f"{nbytes >> 20}M"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--out", default=str(REPO / "bench/results/kv_transfer.json"), help="JSON report path; '' to only print"
    )
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=BACKENDS)
    parser.add_argument(
        "--blocks",
        nargs="+",
        type=int,
        default=BLOCK_COUNTS,
        help=f"transfer sizes in 64 KiB blocks (default {BLOCK_COUNTS})",
    )
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=PATTERNS)
    parser.add_argument(
        "--local",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure each backend between two actors of one private Ray",
    )
    parser.add_argument(
        "--cross-node",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the transport per pair on two simulated Ray nodes",
    )
    parser.add_argument(
        "--checksum-cost",
        action="store_true",
        help="only measure what checksums cost on a clean 16 MiB shm handoff "
        "(default --out bench/results/kv_transfer_checksum.json)",
    )
    args = parser.parse_args()
    if args.checksum_cost:
        out = REPO / "bench/results/kv_transfer_checksum.json" if args.out == parser.get_default("out") else args.out
        report = measure_checksum_cost(args)
        print(f"{'block ids':10} {'checksums':9} | {'send ms':>8} {'after copy ms':>13} {'handoff ms':>10}")
        for r in report["results"]:
            print(
                f"{r['block_ids']:10} {'on' if r['checksums'] else 'off':9} | {r['send_seconds_median'] * 1e3:8.3f} "
                f"{r['receiver_after_copy_seconds_median'] * 1e3:13.3f} {r['handoff_seconds_median'] * 1e3:10.3f}"
            )
        print("overhead:", {k: {m: f"{v:+.1%}" for m, v in o.items()} for k, o in report["overhead"].items()})
        print("hot 16 MiB, GB/s:", {k: round(v / 1e9, 2) for k, v in report["hot_buffer_costs_16MiB"].items()})
        print(
            "one process, ids moving, ms:",
            {
                p: {k.replace("_seconds_median", ""): round(v * 1e3, 3) for k, v in c.items()}
                for p, c in report["one_process_16MiB"].items()
            },
        )
        if out:
            pathlib.Path(out).write_text(json.dumps(report, indent=2) + "\n")
            print("wrote", out)
        return
    for n in args.blocks:
        if not 1 <= n <= NUM_BLOCKS:
            parser.error(f"--blocks {n}: must be in 1..{NUM_BLOCKS}")
    backends = args.backends

    # The cluster part first: after ray.shutdown() of a private Ray this process cannot drive a
    # cluster any more (its actors are cancelled), while the other order works.
    pair_rows = measure_pairs(args) if args.cross_node else []
    rows, threads = measure_local(args) if args.local else ([], None)

    big = [r for r in rows if r["bytes"] >= 1 << 20]
    mean_ratio = {
        k: {m: statistics.mean(r[f"{m}_ratio_to_memcpy"] for r in big if r["backend"] == k) for m in MODES}
        for k in backends
        if any(r["backend"] == k for r in big)
    }
    default = max(mean_ratio, key=lambda k: mean_ratio[k]["isolated"]) if mean_ratio else None
    report = {
        "benchmark": "kv_transfer",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "ray": ray.__version__,
            "torch_threads_in_actors": threads,
            "load_average_1_5_15": os.getloadavg(),
            "note": "2 cores shared with other developers' jobs: expect noise",
        },
        "layout": {
            "num_layers": LAYOUT.num_layers,
            "num_kv_heads": LAYOUT.num_kv_heads,
            "head_dim": LAYOUT.head_dim,
            "block_size": LAYOUT.block_size,
            "dtype": LAYOUT.dtype,
            "block_bytes": LAYOUT.block_bytes,
        },
        "reps": args.reps,
        "results": rows,
        "mean_ratio_1MiB_plus": mean_ratio,
        "target": "ratio_to_memcpy >= 0.5 for transfers of 1 MiB and more",
        "auto_cpu_default": default,
        "pairwise": {
            "what": "PairwiseTransport between actors on two simulated Ray nodes on this machine: "
            "same node -> shm, different nodes -> gloo over 127.0.0.1",
            "results": pair_rows,
            "mean_ratio_1MiB_plus": pair_summary(pair_rows),
        },
    }
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    if rows:
        print(
            f"{'backend':8} {'block ids':10} {'size':>5} {'memcpy':>7} | {'isolated':>8} "
            f"{'ratio':>5} | {'back-to-back':>12} {'ratio':>5}   (GB/s)"
        )
        for r in rows:
            size = size_label(r["bytes"])
            print(
                f"{r['backend']:8} {r['block_ids']:10} {size:>5} "
                f"{r['memcpy_bytes_per_s'] / 1e9:7.2f} | "
                f"{r['isolated_bytes_per_s'] / 1e9:8.2f} {r['isolated_ratio_to_memcpy']:5.2f} | "
                f"{r['back_to_back_bytes_per_s'] / 1e9:12.2f} "
                f"{r['back_to_back_ratio_to_memcpy']:5.2f}"
            )
        summary = {k: {m: round(v, 2) for m, v in ratios.items()} for k, ratios in mean_ratio.items()}
        print("mean ratio for >= 1 MiB:", summary, "-> auto CPU default:", default)
    if pair_rows:
        print(
            f"\ntransport per pair on two Ray nodes\n{'placement':10} {'chosen':6} {'block ids':10} {'size':>5} | "
            f"{'isolated':>8} {'ratio':>5} | {'back-to-back':>12} {'ratio':>5}   (GB/s)"
        )
        for r in pair_rows:
            size = size_label(r["bytes"])
            print(
                f"{r['placement']:10} {r['backend']:6} {r['block_ids']:10} {size:>5} | "
                f"{r['isolated_bytes_per_s'] / 1e9:8.2f} {r['isolated_ratio_to_memcpy']:5.2f} | "
                f"{r['back_to_back_bytes_per_s'] / 1e9:12.2f} {r['back_to_back_ratio_to_memcpy']:5.2f}"
            )
        print("mean ratio for >= 1 MiB:", pair_summary(pair_rows))
    if args.out:
        print("wrote", args.out)


if __name__ == "__main__":
    main()
