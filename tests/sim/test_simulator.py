"""The cluster simulator: it runs the router's own policy and index and the workers' own scheduler,
and its timings match hand-computed oracles on cases simple enough to work out on paper."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from pathlib import Path

import pytest

import cluster.launcher
import cluster.sim.simulator as simulator_module
import router.prefix_index
import router.routing
import workers.engine.block_manager
import workers.engine.scheduler
from cluster.sim import (
    LINKS,
    SLO,
    Client,
    ClusterSpec,
    EngineSettings,
    FittedCostModel,
    LinkModel,
    ServingOverheads,
    SimRequest,
    Simulator,
    Workload,
    simulate,
)
from cluster.sim.engine import EventLoop
from common.sampling_params import SamplingParams
from router.routing import RoutingConfig
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence

STEP = 0.010  # a cost model where every step takes 10 ms, whatever it holds
CONSTANT = FittedCostModel(
    {"c0": STEP, "c_token": 0.0, "c_sampled": 0.0, "c_decode_ctx": 0.0, "c_prefill_pairs": 0.0, "c_decode_seq": 0.0},
    knee=1,
    kv_bytes_per_token=1000,
    kv_capacity_tokens=1 << 20,
)
OVERHEADS = ServingOverheads(router_s=0.002, rpc_s=0.001, stream_s=0.0005, heartbeat_s=0.5)
LINK = LinkModel("test", bandwidth_bytes_s=1e9, latency_s=1e-4)


def prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1000, 40000) for _ in range(n))


def one(prompt_tokens: tuple[int, ...], output_len: int) -> Workload:
    return Workload((Client.closed_loop("c", [SimRequest("r0", prompt_tokens, output_len)], 1),))


def test_the_simulator_runs_the_routers_policy_and_index_classes_not_copies(monkeypatch):
    sim = Simulator(ClusterSpec(1, 1), CONSTANT, OVERHEADS, LINK)
    # The very classes the server builds (cluster.launcher calls router.routing.make_policy too).
    assert type(sim.policy) is router.routing.KvAwarePolicy
    assert type(sim.index) is router.prefix_index.PrefixIndex
    assert sim.policy.index is sim.index
    assert simulator_module.make_policy is router.routing.make_policy is cluster.launcher.make_policy
    worker = next(iter(sim.workers.values()))
    assert type(worker.scheduler) is workers.engine.scheduler.Scheduler
    assert type(worker.block_manager) is workers.engine.block_manager.BlockManager
    # No routing or scheduling code of its own in cluster/sim.
    for path in Path(simulator_module.__file__).parent.glob("*.py"):
        source = path.read_text()
        assert "def choose(" not in source and "def match(" not in source and "def schedule(" not in source, path
    # And the policy object really decides every request: count calls on the router's class.
    calls = []
    original = router.routing.KvAwarePolicy.choose
    monkeypatch.setattr(
        router.routing.KvAwarePolicy,
        "choose",
        lambda self, p, w, namespace=None: calls.append(len(p)) or original(self, p, w, namespace),
    )
    rng = random.Random(0)
    reqs = [SimRequest(f"r{i}", prompt(rng, 100 + i), 4) for i in range(7)]
    result = simulate(Workload((Client.closed_loop("c", reqs, 2),)), ClusterSpec(1, 1), CONSTANT, OVERHEADS, LINK)
    assert calls == [100 + i for i in range(7)]
    assert len(result.decision_s) == 7


def test_local_prefill_timing_matches_the_hand_computed_oracle():
    rng = random.Random(1)
    spec = ClusterSpec(0, 1)  # no prefill pool: the decode worker prefills (local_no_prefill_worker)
    res = simulate(one(prompt(rng, 100), 5), spec, CONSTANT, OVERHEADS, LINK)
    rec = res.records[0]
    assert rec.route == "local_no_prefill_worker"
    # router, submit call (one way), one prefill step, stream to the client.
    assert rec.ttft_s == pytest.approx(0.002 + 0.0005 + STEP + 0.0005)
    assert rec.tpot_s == pytest.approx(STEP)  # then one token per step
    assert rec.tokens == 5


def test_remote_prefill_timing_matches_the_hand_computed_oracle():
    rng = random.Random(2)
    spec = ClusterSpec(1, 1, routing=RoutingConfig(local_prefill_threshold=0, seed=0))
    res = simulate(one(prompt(rng, 200), 3), spec, CONSTANT, OVERHEADS, LINK)
    rec = res.records[0]
    assert rec.route == "remote_prefill" and rec.prefill_worker == "prefill-0"
    # reserve on D (there and back), prefill call to P, one step, the send begins as it ends, the KV
    # moves (12 full blocks + the partial one: 13 x 16 tokens x 1000 B), the outcome reaches the
    # router through P's outbox (stream_s), which passes the token on at once (D's start_decode goes
    # out beside it).
    transfer = 1e-4 + 13 * 16 * 1000 / 1e9
    assert rec.ttft_s == pytest.approx(0.002 + 3 * 0.0005 + STEP + transfer + OVERHEADS.stream_s)
    # The first gap: start_decode reaches D (one way), D's step, the stream to the client.
    assert rec.tpot_s == pytest.approx(STEP + (0.0005 + 0.0005) / 2)
    assert res.pools["prefill"].prefill_tokens == 200 and res.pools["decode"].decode_tokens == 2


def test_chunked_prefill_takes_one_step_per_budget():
    rng = random.Random(3)
    spec = ClusterSpec(0, 1, engine=EngineSettings(max_num_batched_tokens=256))
    res = simulate(one(prompt(rng, 1000), 1), spec, CONSTANT, OVERHEADS, LINK)
    assert res.records[0].ttft_s == pytest.approx(0.002 + 0.0005 + 4 * STEP + 0.0005)  # ceil(1000/256) = 4 steps
    assert res.pools["decode"].steps == 4


def test_a_small_kv_cache_preempts_and_every_request_still_finishes():
    rng = random.Random(4)
    spec = ClusterSpec(0, 1, engine=EngineSettings(num_kv_blocks=40, max_num_batched_tokens=512))
    reqs = [SimRequest(f"r{i}", prompt(rng, 120), 100) for i in range(8)]
    sim = Simulator(spec, CONSTANT, OVERHEADS, LINK)
    res = sim.run(Workload((Client.closed_loop("c", reqs, 8),)))
    assert all(r.completed and r.tokens == 100 for r in res.records)
    assert sim.workers["decode-0"].scheduler.num_preemptions > 0
    sim.workers["decode-0"].scheduler.check_invariants()


def test_kv_events_reach_the_router_and_a_shared_prefix_hits_the_cache():
    rng = random.Random(5)
    system = prompt(rng, 320)
    reqs = [SimRequest(f"r{i}", system + prompt(rng, 40), 2) for i in range(6)]
    spec = ClusterSpec(2, 1, routing=RoutingConfig(seed=0))
    # One request at a time, a heartbeat between them: the router has seen the first's KV events.
    workload = Workload((Client("c", (tuple(reqs),), 1, think_s=0.6),))
    sim = Simulator(spec, CONSTANT, OVERHEADS, LINK)
    res = sim.run(workload)
    later = res.records[1:]
    assert all(r.cached_tokens == 320 for r in later), [r.cached_tokens for r in later]
    # The cache that hit is where the router sent them: all on the prefill worker holding the prefix.
    assert len({r.prefill_worker for r in later}) == 1
    assert sim.index.num_blocks(later[0].prefill_worker) >= 20


def test_goodput_and_attainment_follow_the_slo():
    rng = random.Random(6)
    reqs = [SimRequest(f"r{i}", prompt(rng, 64), 8) for i in range(20)]
    res = simulate(Workload((Client.closed_loop("c", reqs, 4),)), ClusterSpec(0, 1), CONSTANT, OVERHEADS, LINK)
    ttfts = sorted(r.ttft_s for r in res.records)
    cut = ttfts[9]
    summary = res.summary(SLO(ttft_s=cut))
    assert summary["slo_attainment"] == pytest.approx(sum(t <= cut for t in ttfts) / 20)
    assert summary["goodput"] == pytest.approx(sum(t <= cut for t in ttfts) / res.duration_s)
    assert res.summary(SLO(tpot_s=STEP / 2))["slo_attainment"] == 0.0


def test_pools_grow_and_drain_while_it_runs():
    rng = random.Random(7)
    reqs = [SimRequest(f"r{i}", prompt(rng, 300), 20, arrival_s=i * 0.05) for i in range(60)]
    sim = Simulator(ClusterSpec(1, 1), CONSTANT, OVERHEADS, LINK)
    events = []

    def control(s: Simulator) -> None:
        if s.loop.now < 1.1:
            events.append(("add", s.add_worker("decode", ready_in_s=0.2)))
        elif s.loop.now < 2.1:
            events.append(("drain", s.drain_worker("decode")))

    sim.every(1.0, control)
    res = sim.run(Workload((Client.open_loop("c", reqs),)))
    assert all(r.completed for r in res.records)
    assert events[0] == ("add", "decode-1") and events[1] == ("drain", "decode-1")
    used = {r.decode_worker for r in res.records}
    assert "decode-1" in used  # it served requests between joining and draining
    assert sim.workers["decode-1"].removed
    late = [r for r in res.records if r.sent_s > 2.2]
    assert late and all(r.decode_worker == "decode-0" for r in late)


def test_the_cpu_shm_link_preset_matches_the_measured_transfer_rate():
    # bench/results/kv_transfer.json: ~0.7-1.0 GB/s for 1 MiB+ transfers, ~60 us per call.
    t = LINKS["cpu-shm"].transfer_time(1 << 20)
    assert 0.001 < t < 0.0016


def test_the_block_table_is_built_as_used_and_hands_out_blocks_as_a_whole_one_would():
    """A simulated H200 worker has 77k blocks, so the block manager builds them as it first hands
    them out. Its free list must still be the documented LRU order: uncached blocks given back
    first, then the never-used ones by id, then cached ones, least recently freed first. Oracle:
    that order kept over every block, as the block manager did before."""
    big = BlockManager(num_blocks=10**7, block_size=16)
    assert big.blocks == [] and big.num_free_blocks == 10**7 and big.usage == 0.0
    bm, rng = BlockManager(num_blocks=24, block_size=4), random.Random(11)
    order = OrderedDict.fromkeys(range(24))  # the oracle's free list
    refs: Counter[int] = Counter()
    heads = [[rng.randrange(1000, 2000) for _ in range(8)] for _ in range(3)]
    live: list[Sequence] = []
    for i in range(600):
        if live and rng.random() < 0.45:
            seq = live.pop(rng.randrange(len(live)))
            for b in reversed(seq.block_ids):  # the tail first
                refs[b] -= 1
                if refs[b] == 0:
                    order[b] = None
                    if bm.blocks[b].block_hash is None:
                        order.move_to_end(b, last=False)
            bm.free(seq)
        else:
            tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 14))]
            tokens = rng.choice(heads)[: rng.randrange(9)] + tail
            seq = Sequence(f"s{i}", tokens, SamplingParams())
            cached = bm.find_cached_prefix(seq)
            need = -(-seq.num_tokens // 4) - len(cached)
            fits = need <= len(order) - sum(1 for b in cached if refs[b] == 0)
            assert bm.allocate_prefix_and_new(seq, cached, seq.num_tokens - 4 * len(cached)) == fits
            if not fits:
                continue
            for b in cached:
                if refs[b] == 0:
                    del order[b]
            expected = cached + [order.popitem(last=False)[0] for _ in range(need)]
            assert seq.block_ids == expected
            refs.update(expected)
            seq.num_computed_tokens = seq.num_tokens
            bm.cache_computed_blocks(seq)
            live.append(seq)
        assert bm.num_free_blocks == len(order)
    assert len(bm.blocks) == 24 and bm.prefix_hits > 0  # every block used, prefixes hit along the way
    bm.check_invariants(refs)


def test_grouped_callbacks_run_when_and_in_the_order_separate_ones_would():
    """A step's outputs share one heap entry (EventLoop.after_grouped); the oracle is the same
    callbacks scheduled one by one, ties included (zero delays from inside a group, a plain
    callback between grouped ones)."""
    children = {
        "root": [
            (1, "a", True),
            (1, "b", True),
            (1, "c", False),
            (1, "d", True),
            (1, "e", True),
            (2, "f", True),
            (1, "g", True),
        ],
        "a": [(0, "a0", True), (0, "a1", True), (0, "a2", False), (0, "a3", True)],
        "d": [(0, "d0", True), (1, "d1", True)],
        "e": [(1, "e1", True), (0, "e0", True)],
    }

    def drive(grouped: bool) -> tuple[list, int]:
        loop, log = EventLoop(), []

        def fire(name: str) -> None:
            log.append((loop.now, name))
            for dt, child, group in children.get(name, ()):
                (loop.after_grouped if grouped and group else loop.after)(dt, fire, child)

        loop.at(0.0, fire, "root")
        loop.run(until=0.0)
        queued = len(loop)
        loop.run()
        return log, queued

    (separate, queued_separately), (grouped, queued_grouped) = drive(False), drive(True)
    assert grouped == separate and len(separate) == 16
    assert (queued_separately, queued_grouped) == (7, 5)  # a+b and d+e shared an entry


# -- faults: the same handlers of the flow as the router's (tests/sim/test_flow_equivalence.py) --------
def long_requests(n: int, output_len: int, gap_s: float = 0.01, seed: int = 8) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(f"r{i}", prompt(rng, 64), output_len, arrival_s=i * gap_s) for i in range(n)]


def test_a_killed_decode_worker_moves_its_requests_and_each_ends_with_exactly_its_tokens():
    sim = Simulator(ClusterSpec(0, 2), CONSTANT, OVERHEADS, LINK)
    on_it: list[str] = []

    def kill(s: Simulator) -> None:
        if not on_it:
            on_it.extend(s.executor.on_worker("decode-0"))
            s.kill_worker("decode-0")

    sim.every(0.3, kill)
    res = sim.run(Workload((Client.open_loop("c", long_requests(12, 60)),)))
    assert on_it, "nothing was running on the worker when it died"
    assert all(r.completed and r.tokens == 60 for r in res.records)
    moved = {r.request_id for r in res.records if r.migrations}
    assert moved == set(on_it) and sim.counters["migrations"] == len(on_it)
    assert all(r.decode_worker == "decode-1" for r in res.records if r.request_id in moved)
    assert sim.workers["decode-0"].dead and not sim.executor.flights


def test_a_killed_decode_worker_that_restarts_serves_again_with_an_empty_cache():
    sim = Simulator(ClusterSpec(0, 2), CONSTANT, OVERHEADS, LINK)
    sim.loop.at(0.2, sim.kill_worker, "decode-0", 0.5)
    reqs = long_requests(40, 20, gap_s=0.05)
    res = sim.run(Workload((Client.open_loop("c", reqs),)))
    assert all(r.completed and r.tokens == 20 for r in res.records)
    assert sim.pool_size("decode", False) == 2 and len(sim.retired) == 1
    assert any(r.decode_worker == "decode-0" and r.sent_s > 0.8 for r in res.records)  # back in the pool


def test_a_drained_decode_worker_moves_what_it_runs_after_the_drain_timeout():
    spec = ClusterSpec(0, 2, drain_timeout_s=0.2)
    sim = Simulator(spec, CONSTANT, OVERHEADS, LINK)
    drained: list[tuple[str | None, list[str]]] = []

    def drain(s: Simulator) -> None:
        if not drained:
            drained.append((s.drain_worker("decode", "decode-1"), s.executor.on_worker("decode-1")))

    sim.every(0.15, drain)
    res = sim.run(Workload((Client.open_loop("c", long_requests(10, 80)),)))
    wid, on_it = drained[0]
    assert wid == "decode-1" and on_it
    assert all(r.completed and r.tokens == 80 for r in res.records)
    # Moved without using an attempt (a drain is no failure), and the worker left once idle.
    assert {r.request_id for r in res.records if r.migrations} == set(on_it)
    assert sim.counters["migrations"] == len(on_it) and sim.counters["migrations_failed"] == 0
    assert sim.workers["decode-1"].removed and not sim.workers["decode-1"].dead


def test_failed_prefills_are_done_by_the_decode_worker():
    spec = ClusterSpec(1, 1, routing=RoutingConfig(local_prefill_threshold=0, seed=0))
    sim = Simulator(spec, CONSTANT, OVERHEADS, LINK)
    sim.workers["prefill-0"].fail_prefills = True
    res = sim.run(Workload((Client.open_loop("c", long_requests(20, 4, gap_s=0.02)),)))
    assert all(r.completed and r.tokens == 4 for r in res.records)
    assert all(r.route == "remote_prefill_fallback_local" and r.prefill_worker is None for r in res.records)
    assert sim.counters["prefill_fallbacks"] == sim.counters["local_prefill"] == 20
    assert sim.counters["remote_prefill"] == 0


def test_a_prefill_worker_that_dies_mid_prefill_fails_over_to_another():
    rng = random.Random(9)
    spec = ClusterSpec(2, 1, routing=RoutingConfig(local_prefill_threshold=0, seed=0))
    sim = Simulator(spec, CONSTANT, OVERHEADS, LINK)
    reqs = [SimRequest(f"r{i}", prompt(rng, 1000), 4, arrival_s=i * 0.03) for i in range(12)]
    killed: list[tuple[str, list[str]]] = []

    def kill_one_mid_prefill(s: Simulator) -> None:
        for wid in ("prefill-0", "prefill-1"):
            on_it = s.executor.on_worker(wid)
            if not killed and on_it and s.workers[wid].busy:
                killed.append((wid, on_it))
                s.kill_worker(wid)

    sim.every(0.005, kill_one_mid_prefill)
    res = sim.run(Workload((Client.open_loop("c", reqs),)))
    assert killed
    assert all(r.completed and r.tokens == 4 for r in res.records)
    # What the dead worker held was prefilled again by the other one (or by the decode worker).
    assert sim.counters["prefill_retries"] >= 1 and sim.counters["prefill_fallbacks"] >= 1
