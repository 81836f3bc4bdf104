"""1,000 H200 GPUs serving an 8B- and a 70B-class model in FP8 at 10,000 requests/s, on paper and
in the simulator, with the router's real decision code in the loop (docs/scale.md).

1. Sizing (roofline cost model, cluster/sim/costs.py): per-worker prefill and decode capacity for
   a chat workload (lognormal prompts, mean ~1,200 tokens with a 512-token system prompt on 70% of
   requests from 64 groups; lognormal outputs, mean ~255), SLOs TTFT 1 s / TPOT 50 ms (8B) and
   2 s / 60 ms (70B): GPUs needed for 10,000 req/s, and the rate 1,000 GPUs sustain.
2. Checked by the simulator: a 5% slice of the 1,000 GPUs (50 GPUs, the balanced split) at 5% of
   the rate, 20 s of traffic, real routing policy, prefix index and scheduler.
3. The router at full scale: the real `KvAwarePolicy` choosing among 1,000 GPUs' workers (in the
   simulator, 1 s of 10,000 req/s; and standalone over a large prefix index), its decision time,
   the prefix index's memory per cached block, and the router's other per-request CPU (HTTP,
   tokenisation, SSE) measured on the real app over an in-process backend: where one router
   process saturates, and how many shards 10,000 req/s needs.

    .venv/bin/python -m bench.sim_scale [--slice-seconds 20] [--full-seconds 1]

Writes bench/results/sim_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

from cluster.planner import PlanProblem, capacity_estimate
from cluster.sim import (
    GPUS,
    LINKS,
    MODELS,
    SLO,
    ClusterSpec,
    EngineSettings,
    LengthDist,
    RooflineCostModel,
    ServingOverheads,
    Simulator,
    WorkloadSpec,
)
from common.block_hash import hash_prefix_blocks
from common.stats import summary as percentiles
from router.app import build_app
from router.backend import WorkerInfo
from router.prefix_index import PrefixIndex
from router.routing import KvAwarePolicy, RoutingConfig
from router.tokenizer import Tokenizer
from testkit.backend import FakeBackend
from workers.models.files import resolve_model_dir

GPUS_TOTAL = 1000
RATE = 10_000.0
# 64-token blocks in the simulated GPU workers: the real BlockManager keeps one Python object per block,
# and an H200 holds ~1.8M KV tokens of the 8B model (113k blocks of 16). Prefix hits then count in
# whole 64-token blocks. The standalone decision timing below uses the default 16.
ENGINE = EngineSettings(block_size=64, max_num_seqs=256, max_num_batched_tokens=8192)
WORKLOAD = WorkloadSpec(
    rate=RATE,
    prompt_len=LengthDist("lognormal", low=64, high=8192, mean=600, sigma=0.8),
    output_len=LengthDist("lognormal", low=16, high=2048, mean=200, sigma=0.7),
    prefix_groups=64,
    prefix_len=512,
    prefix_fraction=0.7,
    seed=1,
    name="chat",
)
MODELS_STUDIED = {  # name: (model, tensor-parallel size per worker, SLO)
    "8B FP8, TP1": ("llama-8b", 1, SLO(1.0, 0.05)),
    "70B FP8, TP2": ("llama-70b", 2, SLO(2.0, 0.06)),
}


def sizing(cost: RooflineCostModel, slo: SLO) -> dict:
    est = capacity_estimate(PlanProblem(GPUS_TOTAL, WORKLOAD, slo, cost, engine=ENGINE))
    tp = cost.tp
    p_cap, d_cap = est["prefill_requests_per_s_per_worker"], est["decode_requests_per_s_per_worker"]
    p_need, d_need = math.ceil(RATE / p_cap), math.ceil(RATE / d_cap)
    workers = GPUS_TOTAL // tp
    p = round(est["balanced_prefill_workers"])
    return {
        **est,
        "gpus_per_worker": tp,
        "kv_tokens_per_worker": cost.kv_capacity_tokens(),
        "workers_for_10k": {"prefill": p_need, "decode": d_need},
        "gpus_for_10k": (p_need + d_need) * tp,
        "split_on_1000_gpus": {"prefill": p, "decode": workers - p},
        "max_rate_on_1000_gpus": min(p * p_cap, (workers - p) * d_cap),
    }


def queue_threshold(size: dict, slo: SLO) -> int:
    """Prompt tokens a prefill worker gets through in half the TTFT SLO: the router's default (8,192,
    sized for this CPU) is under one GPU step, and past it decode workers prefill locally."""
    return int(size["prefill_requests_per_s_per_worker"] * WORKLOAD.mean_prompt_len() * slo.ttft_s / 2)


def simulate_slice(
    cost: RooflineCostModel, slo: SLO, split: dict, rate: float, seconds: float, fraction: float, threshold: int | None
) -> dict:
    workers = round(GPUS_TOTAL * fraction) // cost.tp
    p = max(1, round(split["prefill"] * fraction))
    routing = RoutingConfig(seed=0) if threshold is None else RoutingConfig(seed=0, prefill_queue_threshold=threshold)
    spec = ClusterSpec(p, workers - p, ENGINE, routing, drain_limit_s=30)
    sim = Simulator(
        spec,
        cost,
        ServingOverheads(router_s=0.002, rpc_s=0.0005, stream_s=0.001),
        LINKS["infiniband"],
        record_itl=False,
    )
    res = sim.run(replace(WORKLOAD, rate=rate * fraction, duration_s=seconds).generate())
    s = res.summary(slo)
    return {
        "gpus": workers * cost.tp,
        "prefill_workers": p,
        "decode_workers": workers - p,
        "rate": rate * fraction,
        "prefill_queue_threshold": routing.prefill_queue_threshold,
        "simulated_s": seconds,
        "requests": s["requests"],
        "slo_attainment": s["slo_attainment"],
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "cached_token_fraction": s["cached_token_fraction"],
        "routes": s["routes"],
        "pool_utilisation": {
            k: v.busy_seconds / v.gpu_seconds * cost.tp for k, v in res.pools.items() if v.gpu_seconds
        },
        "router_decision_ms": percentiles(res.decision_s),
        "simulation_wall_s": res.sim_wall_s,
    }


def full_scale_in_loop(cost: RooflineCostModel, split: dict, seconds: float) -> dict:
    """All 1,000 GPUs' workers at 10,000 req/s for a short window: the decision time in the loop."""
    # Decision timing only: each worker's cache capped at 2,048 blocks to fit 1,000 workers in memory.
    spec = ClusterSpec(
        split["prefill"], split["decode"], replace(ENGINE, num_kv_blocks=2048), RoutingConfig(seed=0), drain_limit_s=0.0
    )
    sim = Simulator(spec, cost, ServingOverheads(), LINKS["infiniband"], record_itl=False)
    res = sim.run(replace(WORKLOAD, duration_s=seconds).generate())
    return {
        "workers": split["prefill"] + split["decode"],
        "requests_routed": len(res.decision_s),
        "router_decision_ms": percentiles(res.decision_s),
        "simulation_wall_s": res.sim_wall_s,
    }


def decision_standalone(n_prefill: int, n_decode: int, tail_blocks_per_worker: int, requests: int) -> dict:
    """KvAwarePolicy.choose over 1,000 workers and a prefix index with system prompts on many workers."""
    rng = random.Random(0)
    infos = [
        WorkerInfo(f"prefill-{i}", "prefill", running=rng.randrange(4), queued_prefill_tokens=rng.randrange(20000))
        for i in range(n_prefill)
    ]
    infos += [
        WorkerInfo(f"decode-{i}", "decode", running=rng.randrange(256), kv_usage=rng.random()) for i in range(n_decode)
    ]
    ids = [w.worker_id for w in infos]
    index = PrefixIndex()
    systems = [[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(64)]
    for s in systems:
        h = hash_prefix_blocks(s, 16)
        for wid in rng.sample(ids, 32):
            index.add(wid, h)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    sample_workers = ids[:50]
    for wid in sample_workers:  # conversation tails: unique blocks
        tail = [rng.randrange(1000, 40000) for _ in range(16 * tail_blocks_per_worker)]
        index.add(wid, hash_prefix_blocks(tail, 16))
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / (len(sample_workers) * tail_blocks_per_worker)
    tracemalloc.stop()
    policy = KvAwarePolicy(index, 16, RoutingConfig(seed=1))
    prompts = []
    for _ in range(200):
        n = int(min(8192, max(64, rng.lognormvariate(math.log(600), 0.8))))
        prefix = rng.choice(systems) if rng.random() < 0.7 else []
        prompts.append(prefix + [rng.randrange(1000, 40000) for _ in range(n)])
    for p in prompts[:20]:
        policy.choose(p, infos)
    times, hash_times = [], []
    for i in range(requests):
        p = prompts[i % len(prompts)]
        t0 = time.perf_counter()
        policy.choose(p, infos)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hash_prefix_blocks(p, 16)
        hash_times.append(time.perf_counter() - t0)
    return {
        "prefill_workers": n_prefill,
        "decode_workers": n_decode,
        "decision_ms": percentiles(times),
        "of_which_hashing_ms": percentiles(hash_times),
        "decisions_per_s_one_core": 1 / statistics.fmean(times),
        "index_bytes_per_cached_block": per_entry,
    }


async def router_cpu_per_request(n: int, output_tokens: int) -> dict:
    """The router app's CPU per request besides routing: HTTP, tokenisation, SSE of every token (the
    in-process client's share included, so an upper bound), over tests/fakes.py's FakeBackend."""
    tokenizer = Tokenizer.from_model_dir(resolve_model_dir(None, quiet=True))
    backend = FakeBackend(tokenizer)
    app = build_app(backend, tokenizer, "m", 1 << 20)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "word " * 600}],
        "max_tokens": output_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:

        async def one():
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass

        await one()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n // 8):
            await asyncio.gather(*(one() for _ in range(8)))
        cpu = time.process_time() - cpu0
    per = cpu / (n // 8 * 8)
    return {
        "requests": n // 8 * 8,
        "output_tokens": output_tokens,
        "cpu_ms_per_request": per * 1e3,
        "cpu_ms_per_output_token": per * 1e3 / output_tokens,
        "wall_s": time.perf_counter() - wall0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice-seconds", type=float, default=20.0)
    ap.add_argument("--slice-fraction", type=float, default=0.05)
    ap.add_argument("--full-seconds", type=float, default=1.0)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/sim_scale.json")
    args = ap.parse_args()
    started = time.perf_counter()
    report = {
        "benchmark": "sim_scale",
        "gpus": GPUS_TOTAL,
        "gpu": "H200",
        "rate": RATE,
        "workload": WORKLOAD.to_dict(),
        "mean_prompt_tokens": WORKLOAD.mean_prompt_len(),
        "mean_output_tokens": WORKLOAD.output_len.expected(),
        "engine": ENGINE.__dict__,
        "command": " ".join(["python"] + sys.argv),
        "machine": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0],
        },
        "models": {},
    }
    for name, (model, tp, slo) in MODELS_STUDIED.items():
        cost = RooflineCostModel(GPUS["H200"], MODELS[model], "fp8", "fp8", tp)
        size = sizing(cost, slo)
        entry = {"cost_model": cost.to_dict(), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "sizing": size}
        rate = min(RATE, size["max_rate_on_1000_gpus"])
        threshold = queue_threshold(size, slo)
        split = size["split_on_1000_gpus"]
        entry["slice_at_10k"] = simulate_slice(
            cost, slo, split, RATE, args.slice_seconds, args.slice_fraction, threshold
        )
        entry["slice_at_10k_default_queue_threshold"] = simulate_slice(
            cost, slo, split, RATE, args.slice_seconds, args.slice_fraction, None
        )
        if rate < RATE:
            entry["slice_at_estimated_max"] = simulate_slice(
                cost, slo, split, rate, args.slice_seconds, args.slice_fraction, threshold
            )
            entry["slice_at_fraction_of_estimated_max"] = {
                str(f): simulate_slice(cost, slo, split, rate * f, args.slice_seconds, args.slice_fraction, threshold)
                for f in (0.8, 0.9)
            }
            # Splits with more decode workers than the estimate's balance, at 6,000 req/s.
            workers = round(GPUS_TOTAL * args.slice_fraction) // cost.tp
            entry["slice_other_splits_at_6000"] = {
                f"{p}P:{workers - p}D": simulate_slice(
                    cost,
                    slo,
                    {"prefill": round(p / args.slice_fraction), "decode": round((workers - p) / args.slice_fraction)},
                    6000,
                    args.slice_seconds,
                    args.slice_fraction,
                    threshold,
                )
                for p in (15, 12)
            }
        print(name, json.dumps({k: entry[k] for k in entry if k.startswith("slice")}, default=str)[:1500], flush=True)
        report["models"][name] = entry
    first = next(iter(MODELS_STUDIED.values()))
    cost8 = RooflineCostModel(GPUS["H200"], MODELS[first[0]], "fp8", "fp8", first[1])
    split8 = report["models"][next(iter(MODELS_STUDIED))]["sizing"]["split_on_1000_gpus"]
    if args.full_seconds > 0:
        report["full_scale_in_loop"] = full_scale_in_loop(cost8, split8, args.full_seconds)
        print("full scale", report["full_scale_in_loop"], flush=True)
    report["decision_standalone"] = decision_standalone(split8["prefill"], split8["decode"], 2000, args.decisions)
    print("decision", report["decision_standalone"], flush=True)
    report["router_cpu"] = asyncio.run(router_cpu_per_request(64, 256))
    print("router cpu", report["router_cpu"], flush=True)
    d = report["decision_standalone"]
    decide_ms = d["decision_ms"]["p50"]  # the mean and tail carry this shared machine's contention
    other_ms = report["router_cpu"]["cpu_ms_per_request"] / 256 * WORKLOAD.output_len.expected()
    per_request_ms = decide_ms + other_ms
    report["router_saturation"] = {
        "decision_ms_per_request": decide_ms,
        "other_cpu_ms_per_request": other_ms,
        "requests_per_s_one_process": 1000 / per_request_ms,
        "decision_only_requests_per_s": 1000 / decide_ms,
        "processes_for_10k_at_70pct": math.ceil(RATE * per_request_ms / 1000 / 0.7),
        "index_gb_if_every_cached_block_indexed": d["index_bytes_per_cached_block"]
        * sum((GPUS_TOTAL // cost8.tp) * cost8.kv_capacity_tokens() / 16 for _ in [0])
        / 1e9,
    }
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["router_saturation"], indent=2))


if __name__ == "__main__":
    main()
