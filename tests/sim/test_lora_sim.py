"""LoRA in the simulator: adapters drawn for a workload, slots and host memory as the worker keeps
them, the scheduler's adapter limit, load and per-adapter step costs, adapter-aware routing on
the workers' reported LoRAStatus, and the planner with an adapter mix. Seconds in all."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest

import router.routing
import workers.engine.scheduler
from cluster.cli import main as baton
from cluster.planner import PlanProblem, capacity_estimate, probe
from cluster.sim import (
    SLO,
    Client,
    ClusterSpec,
    EngineSettings,
    FittedCostModel,
    LengthDist,
    ServingOverheads,
    SimRequest,
    Simulator,
    Workload,
    WorkloadSpec,
    simulate,
)
from cluster.sim.executor import worker_request
from cluster.sim.lora import AdapterResidency, LoRACosts
from cluster.sim.workload import AdapterMix, read_trace, write_trace
from common.lora import LoRALimits
from router.routing import RoutingConfig
from tests.sim.machine import MACHINE_COST, write_profile

COST = MACHINE_COST  # a worker like this machine's
STEP = 0.010  # every step 10 ms, whatever it holds
CONSTANT = FittedCostModel(
    {"c0": STEP, "c_token": 0.0, "c_sampled": 0.0, "c_decode_ctx": 0.0, "c_prefill_pairs": 0.0, "c_decode_seq": 0.0},
    knee=1,
    kv_bytes_per_token=1000,
    kv_capacity_tokens=1 << 20,
)
OVERHEADS = ServingOverheads(heartbeat_s=0.5)
LORA = EngineSettings(max_loras=2)


def lora_workload(seed: int, rate: float = 2.0, duration_s: float = 30.0, **mix) -> WorkloadSpec:
    return WorkloadSpec(
        rate=rate,
        duration_s=duration_s,
        prompt_len=LengthDist("uniform", low=32, high=128),
        output_len=LengthDist("uniform", low=16, high=64),
        seed=seed,
        adapters=AdapterMix(8, "zipf", seed=seed, **mix),
    )


def prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1000, 40000) for _ in range(n))


def test_a_simulated_request_runs_under_its_adapter_and_its_kv_namespace():
    tokens = (1000, 1001, 1002)
    ctx = worker_request(SimRequest("r", tokens, 4, adapter="sql")).context
    assert (ctx.adapter, ctx.kv_namespace, ctx.model) == ("sql", "sql", "sql")
    base = worker_request(SimRequest("r", tokens, 4)).context
    assert (base.adapter, base.kv_namespace, base.model) == (None, None, "")
    with pytest.raises(ValueError, match="adapter"):
        SimRequest("r", tokens, 4, adapter="")


def test_an_adapter_mix_is_seeded_zipf_with_a_base_share_and_leaves_the_arrivals_alone(tmp_path):
    plain = WorkloadSpec(rate=20, duration_s=60, seed=5, prompt_len=LengthDist("fixed", 8))
    mixed = dataclasses.replace(plain, adapters={"count": 4, "zipf_s": 1.0, "base_fraction": 0.25, "seed": 1})
    a, b = plain.generate().clients[0].requests, mixed.generate().clients[0].requests
    assert [(r.request_id, r.prompt, r.output_len, r.arrival_s) for r in a] == [
        (r.request_id, r.prompt, r.output_len, r.arrival_s) for r in b
    ]
    assert all(r.adapter is None for r in a)
    counts = Counter(r.adapter for r in b)
    assert set(counts) == {None, "lora-0", "lora-1", "lora-2", "lora-3"}
    shares = mixed.adapters.probabilities()
    assert sum(shares.values()) == pytest.approx(1.0)
    n = len(b)
    for name, p in shares.items():  # within 4 standard deviations of the binomial
        assert abs(counts[name] - n * p) < 4 * (n * p * (1 - p)) ** 0.5, (name, counts)
    assert counts["lora-0"] > counts["lora-1"] > counts["lora-3"]
    assert [r.adapter for r in mixed.generate().clients[0].requests] == [r.adapter for r in b]  # seeded
    # A conversation keeps its adapter over its turns.
    chats = Workload(
        (Client("c", tuple((SimRequest(f"{i}a", (1,), 1), SimRequest(f"{i}b", (1,), 1)) for i in range(20))),)
    )
    for unit in AdapterMix(8).assign(chats).clients[0].units:
        assert unit[0].adapter == unit[1].adapter is not None
    # Traces carry it.
    path = tmp_path / "t.jsonl"
    write_trace(path, b)
    assert [r.adapter for r in read_trace(path).clients[0].requests] == [r.adapter for r in b]
    with pytest.raises(ValueError, match="dist"):
        AdapterMix(4, "pareto")
    with pytest.raises(ValueError, match="unknown adapter mix keys"):
        WorkloadSpec.from_dict({"adapters": {"count": 2, "skew": 3}})


def test_slots_and_host_memory_are_least_recently_used_as_the_workers_manager_keeps_them():
    res = AdapterResidency(LoRALimits(2, max_cpu_loras=3), LoRACosts())
    assert res.load_for(["a", None, "a"]) == (1, 1, 1)  # one adapter, a slot load and a disk load
    assert res.load_for(["b"]) == (1, 1, 1)
    assert res.load_for(["a", "b", None]) == (2, 0, 0)  # both resident
    assert res.load_for(["c"]) == (1, 1, 1)  # evicts slot 0's a (the least recently used slot)
    assert res.resident == ["c", "b"] and list(res.host) == ["a", "b", "c"]
    assert res.load_for(["a", "c"]) == (2, 1, 0)  # a from host memory into b's slot
    assert res.load_for(["d"]) == (1, 1, 1)  # host holds 3: b, read least recently into a slot, goes
    assert list(res.host) == ["c", "a", "d"] and res.load_for(["b"]) == (1, 1, 1)
    assert res.load_for([None]) == (0, 0, 0)
    assert res.counters.steps_by_adapters == {1: 5, 2: 2, 0: 1}
    status = res.status(["b", None, "b"], ["d"])
    assert status.running == ("b",) and status.waiting == ("d",) and status.max_loras == 2
    assert (status.slot_loads, status.disk_loads) == (6, 5)
    res.add("e")  # loaded by name: into host memory, uncounted
    assert res.load_for(["e"]) == (1, 1, 0)
    with pytest.raises(AssertionError):  # the scheduler never builds such a step
        res.load_for(["a", "b", "c"])


def test_a_step_waits_for_its_adapters_loads_and_pays_for_each_adapter_in_its_batch():
    # One worker (it prefills too), every step 10 ms: an adapter's first request waits for a disk
    # and a slot load, and each of its steps costs step_fraction more; the next request of the
    # same adapter finds it resident.
    costs = dict(lora_slot_load_s=0.003, lora_disk_load_s=0.02, lora_step_fraction=0.1)
    rng = random.Random(0)
    reqs = [SimRequest("base", prompt(rng, 64), 5)] + [
        SimRequest(f"a{i}", prompt(rng, 64), 5, adapter="a") for i in range(2)
    ]
    on = simulate(
        Workload((Client("c", (tuple(reqs),), 1),)),
        ClusterSpec(0, 1, EngineSettings(max_loras=1, **costs)),
        CONSTANT,
        OVERHEADS,
    )
    base, first, second = on.records
    assert first.ttft_s - base.ttft_s == pytest.approx(STEP * 0.1 + 0.003 + 0.02)
    assert second.ttft_s - base.ttft_s == pytest.approx(STEP * 0.1)
    assert first.tpot_s == pytest.approx(base.tpot_s * 1.1) and second.tpot_s == pytest.approx(base.tpot_s * 1.1)
    summary = on.summary()["lora"]
    assert summary["slot_loads"] == summary["disk_loads"] == 1 and summary["load_s"] == pytest.approx(0.023)
    assert summary["base_requests"] == 1 and summary["adapters"] == {
        "a": {"requests": 2, "completed": 2, "slot_loads": 1, "disk_loads": 1}
    }
    assert summary["steps_by_adapters"] == {"0": 5, "1": 10}


def test_adapter_aware_routing_loads_fewer_adapters_and_no_step_exceeds_the_slots(monkeypatch):
    # 8 adapters, Zipf-distributed, on 2 decode workers of 2 slots each (they prefill too).
    per_step: list[int] = []  # distinct adapters in each step the real scheduler builds
    original_schedule = workers.engine.scheduler.Scheduler.schedule

    def schedule(self):
        out = original_schedule(self)
        n = len({c.seq.adapter for c in out.chunks if c.seq.adapter is not None})
        assert self.max_adapters == 2 and n <= self.max_adapters, (n, self.max_adapters)
        per_step.append(n)
        return out

    seen_lora = []  # the workers' LoRAStatus as the policy ranked them
    original_choose = router.routing.KvAwarePolicy.choose

    def choose(self, prompt_token_ids, workers, context=None):
        seen_lora.extend(w.lora for w in workers)
        return original_choose(self, prompt_token_ids, workers, context)

    monkeypatch.setattr(workers.engine.scheduler.Scheduler, "schedule", schedule)
    monkeypatch.setattr(router.routing.KvAwarePolicy, "choose", choose)
    for seed in range(3):
        wl = lora_workload(seed).generate()
        loads = {}
        for name, routing in (
            ("aware", RoutingConfig(seed=0)),
            ("blind", RoutingConfig(seed=0, weight_lora=0)),
            ("round-robin", RoutingConfig(policy="round-robin", seed=0)),
        ):
            per_step.clear()
            sim = Simulator(ClusterSpec(0, 2, LORA, routing), COST, OVERHEADS)
            result = sim.run(wl)
            assert all(r.completed for r in result.records)
            assert max(per_step) == 2  # the limit binds (8 adapters want in) and holds
            lora = result.summary()["lora"]
            assert set(lora["steps_by_adapters"]) <= {"0", "1", "2"}
            assert sum(lora["steps_by_adapters"].values()) == len(per_step)
            assert sum(a["requests"] for a in lora["adapters"].values()) == len(result.records)
            loads[name] = lora["slot_loads"]
            # What the router saw is what the workers report.
            assert all(w.lora_status().max_loras == 2 for w in sim.workers.values())
        assert loads["aware"] < loads["blind"] and loads["aware"] < loads["round-robin"], (seed, loads)
    # The policy ranked workers on their reported adapters.
    assert seen_lora and all(s.max_loras == 2 for s in seen_lora)
    assert any(s.resident for s in seen_lora) and any(s.running for s in seen_lora)


@pytest.mark.parametrize("prefill_workers", [0, 1])
def test_a_base_only_workload_is_unchanged_by_lora(prefill_workers):
    wl = WorkloadSpec(
        rate=3,
        duration_s=20,
        prompt_len=LengthDist("uniform", low=32, high=256),
        output_len=LengthDist("uniform", low=8, high=48),
        prefix_groups=2,
        prefix_len=64,
        prefix_fraction=0.5,
        seed=9,
    ).generate()
    off = simulate(wl, ClusterSpec(prefill_workers, 2), COST, OVERHEADS)
    on = simulate(wl, ClusterSpec(prefill_workers, 2, EngineSettings(max_loras=2, max_cpu_loras=4)), COST, OVERHEADS)
    assert on.records == off.records and on.timeline == off.timeline and on.duration_s == off.duration_s
    assert {k: v.summary(on.duration_s) for k, v in on.pools.items()} == {
        k: v.summary(off.duration_s) for k, v in off.pools.items()
    }
    assert off.lora is None and "lora" not in off.summary()
    assert on.lora is not None and on.lora.slot_loads == {} and set(on.lora.steps_by_adapters) == {0}


def test_prompts_under_different_adapters_share_no_cached_blocks():
    rng = random.Random(1)
    system = prompt(rng, 128)
    reqs = [SimRequest(f"r{i}", system + prompt(rng, 16), 2, adapter=a) for i, a in enumerate(["x", "y", "x", None])]
    result = simulate(Workload((Client("c", (tuple(reqs),), 1),)), ClusterSpec(0, 1, LORA), COST, OVERHEADS)
    assert [r.cached_tokens for r in result.records] == [0, 0, 128, 0]


def test_the_planner_simulates_an_adapter_mix(monkeypatch):
    wl = lora_workload(1, rate=1.0, duration_s=10.0)
    problem = PlanProblem(
        3,
        wl,
        SLO(3.0, 0.2),
        COST,
        overheads=OVERHEADS,
        engine=EngineSettings(max_loras=2),
        requests_per_probe=30,
        min_probe_s=6,
    )
    runs = []
    original = Simulator.run

    def run(self, workload):
        result = original(self, workload)
        runs.append(result)
        return result

    monkeypatch.setattr(Simulator, "run", run)
    assert probe(problem, 1, 2, 1.0, stop_once_failed=False).attainment is not None
    (result,) = runs
    assert result.lora is not None and result.lora.max_loras == 2 and sum(result.lora.slot_loads.values()) > 0
    assert len({r.adapter for r in result.records}) > 2
    # The estimate counts the adapters a batch runs; without slots for them the problem is refused.
    base = dataclasses.replace(problem, workload=dataclasses.replace(wl, adapters=None))
    est, est_base = capacity_estimate(problem), capacity_estimate(base)
    assert est["decode_requests_per_s_per_worker"] < est_base["decode_requests_per_s_per_worker"]
    with pytest.raises(ValueError, match="max_loras"):
        dataclasses.replace(problem, engine=EngineSettings())


def test_baton_plan_takes_an_adapter_mix(tmp_path, capsys):
    profile = write_profile(tmp_path / "profile.json")
    workload = tmp_path / "w.yaml"
    workload.write_text("rate: 0.5\nduration_s: 20\nprompt_len: {dist: uniform, low: 64, high: 256}\noutput_len: 32\n")
    args = ["plan", "--gpus", "2", "--model-profile", str(profile), "--slo-ttft", "3s", "--slo-tpot", "200ms"]
    args += ["--workload", str(workload), "--requests-per-probe", "20", "--json", str(tmp_path / "p.json")]
    args += ["--lora-adapters", "6", "--lora-base-fraction", "0.2", "--max-loras", "2", "--lora-slot-load", "4ms"]
    assert baton(args) == 0
    out = capsys.readouterr().out
    assert "LoRA: 6 adapters (zipf, s=1, 20% base model), max_loras 2" in out, out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["engine"]["max_loras"] == 2 and data["engine"]["lora_slot_load_s"] == 0.004
    assert data["workload"]["adapters"]["count"] == 6
    lora = data["at_workload_rate"]["lora"]
    assert lora["adapters"] and set(lora["adapters"]) <= {f"lora-{k}" for k in range(6)}
    requests = lora["base_requests"] + sum(a["requests"] for a in lora["adapters"].values())
    assert requests == data["at_workload_rate"]["requests"]
