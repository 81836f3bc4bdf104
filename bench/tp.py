"""Decode step time of the engine at tensor-parallel sizes 1, 2 and 3 on this machine, and what
a KV handoff moves between prefill and decode groups of every pair of sizes.

    .venv/bin/python -m bench.tp [--steps 64] [--prompt-tokens 64] [--rounds 2] [--handoff-tokens 1024]
                                 [--out bench/results/tp_step_cpu.json]

Setup: float32, the engine alone (no router, no Ray), one stream: a prompt of `--prompt-tokens`
random tokens is prefilled, then `--steps` single-sequence decode steps are timed (wall clock of
each engine step, LLMEngine.observe_steps). Each configuration runs in its own spawned processes
(testkit.tensor_parallel.run_group: TP N is N rank processes, rank 0 scheduling and broadcasting each
step, joined by gloo all-reduces on 127.0.0.1). Two models:
  - "default": SmolLM2-135M-Instruct. Its 9 query heads allow TP 1, 3 and 9 but not 2, so it is
    timed at TP 1 and TP 3 (three single-threaded ranks on two cores: oversubscribed);
  - "smollm2_shape_12_heads": a random Llama with SmolLM2-135M's every weight shape (hidden 576,
    30 layers, intermediate 1536, vocabulary 49152, q/k/v of 576/192/192 rows) cut into 12
    query and 4 KV heads of 48, so that TP 2 divides it; timed at TP 1 and TP 2.
Per model: TP 1 with one torch thread (one core), TP N with one thread per rank, and TP 1 with
as many threads as TP N has ranks (the same cores, without collectives). The configurations run
`--rounds` times, interleaved, and each reports the median over all its timed steps (rank 0's),
since the machine's 2 cores are shared with other work (`load_average_1m` records how busy it
was at the start). Also checked: every TP N's greedy tokens equal TP 1's.

Handoffs: one request of `--handoff-tokens` tokens (whole blocks of 16) handed from a prefill
group to a decode group (kvtransfer.resharding, the shared-memory backend every pair on one node
uses), for each pair of sizes of the two models' KV shapes (3 KV heads of 64; 4 of 48), float32:
the transfers it takes (its links), the bytes of each and in all (every head of every block once:
the same bytes as TP 1 -> 1), and its wall time, median of `--rounds` x 5 handoffs. The ranks of
each group are in this one process and send one after another (in a served worker they send at
once, each from its own process), and the staging or inlet copy is included.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from testkit.tensor_parallel import GroupJob, run_group
from workers.config import EngineConfig
from workers.models.files import resolve_model_dir

# (KV shape, prefill TP, decode TP)
HANDOFF_PAIRS = [
    ("default", 1, 1),
    ("default", 3, 3),
    ("default", 3, 1),
    ("default", 1, 3),
    ("smollm2_shape_12_heads", 2, 2),
    ("smollm2_shape_12_heads", 2, 4),
    ("smollm2_shape_12_heads", 4, 2),
    ("smollm2_shape_12_heads", 2, 1),
    ("smollm2_shape_12_heads", 1, 2),
]
KV_SHAPES = {"default": (30, 3, 64), "smollm2_shape_12_heads": (30, 4, 48)}  # layers, KV heads, head_dim

# (model, tp size, torch threads per rank)
CONFIGS = [
    ("default", 1, 1),
    ("default", 3, 1),
    ("default", 1, 2),
    ("smollm2_shape_12_heads", 1, 1),
    ("smollm2_shape_12_heads", 2, 1),
    ("smollm2_shape_12_heads", 1, 2),
]


def smollm2_shaped_model(folder: str) -> str:
    """Save a random Llama with SmolLM2-135M's weight shapes in 12 heads of 48 (see the docstring)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=48,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _collectives_rank(rank: int, size: int, init_method: str, compute_s: float, iterations: int, out_dir: str) -> None:
    """One rank of the collectives micro-benchmark: all-reduces of one token's hidden state, each after
    compute_s of busy work (a layer's share of compute, which the other ranks wait for), then step
    broadcasts of a one-sequence decode step's inputs."""
    import torch

    from common.sampling_params import SamplingParams
    from workers.engine.sequence import ScheduledChunk, Sequence
    from workers.engine.step_inputs import StepInputs
    from workers.parallel.group import TPGroup

    torch.set_num_threads(1)
    group = TPGroup.connect(rank, size, init_method, "cpu")
    hidden = torch.randn(1, 576)
    seq = Sequence("s", list(range(100, 170)), SamplingParams())
    seq.block_ids, seq.num_computed_tokens = list(range(5)), 69
    step = StepInputs.of([ScheduledChunk(seq, 1)], [True], block_size=16)
    seconds = {}
    for name in ("allreduce", "broadcast"):
        started = time.perf_counter()
        for _ in range(iterations):
            if name == "allreduce":
                until = time.perf_counter() + compute_s
                while time.perf_counter() < until:
                    pass
                group.all_reduce(hidden)
            elif rank == 0:
                group.broadcast_step(step)
            else:
                group.receive_step()
        seconds[name] = (time.perf_counter() - started) / iterations
    seconds["allreduce"] -= compute_s
    if rank == 0:
        Path(out_dir, "collectives.json").write_text(json.dumps(seconds))
    group.close()


def collective_costs(size: int, compute_s: float, iterations: int = 600) -> dict[str, float]:
    """Seconds of one all-reduce (between compute_s of work per rank) and of one step broadcast in a
    group of `size` rank processes on this machine (gloo on 127.0.0.1)."""
    import torch.multiprocessing as mp

    from common.net import free_port

    with tempfile.TemporaryDirectory(prefix="baton-bench-collectives-") as out_dir:
        mp.start_processes(
            _collectives_rank,
            args=(size, f"tcp://127.0.0.1:{free_port()}", compute_s, iterations, out_dir),
            nprocs=size,
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(out_dir, "collectives.json").read_text())


def simulated_tp_steps(results: list[dict]) -> list[dict]:
    """The simulator's TP cost (cluster.sim.costs.TensorParallelCost) for each measured TP > 1 step,
    from the TP 1 one-thread step measured beside it and this machine's collectives."""
    from cluster.sim.costs import MODELS, FittedCostModel, StepShape, TensorParallelCost

    shape = MODELS["smollm2-135m"]  # both models here have its weight shapes
    out = []
    for r in results:
        if r["tensor_parallel_size"] == 1:
            continue
        tp = r["tensor_parallel_size"]
        base = (
            next(
                b["median_decode_step_ms"]
                for b in results
                if b["model"] == r["model"] and b["tensor_parallel_size"] == 1 and b["threads_per_rank"] == 1
            )
            / 1e3
        )
        layer_share = base * shape.sharded_weight_fraction / tp / (2 * shape.layers)
        costs = collective_costs(tp, layer_share)
        # One rank's step as measured here: a fitted model whose every step costs that much.
        measured_step = FittedCostModel(
            {"c0": base, **dict.fromkeys(FittedCostModel.COEFFICIENTS[1:], 0.0)},
            knee=1,
            kv_bytes_per_token=1,
            kv_capacity_tokens=1,
        )
        model = TensorParallelCost(
            measured_step, tp, shape.layers, shape.sharded_weight_fraction, costs["allreduce"], costs["broadcast"]
        )
        predicted = model.step_time(StepShape.of([(64, 1, True)]))
        measured = r["median_decode_step_ms"] / 1e3
        out.append(
            {
                "model": r["model"],
                "tensor_parallel_size": tp,
                "tp1_step_ms": round(base * 1e3, 2),
                "sharded_fraction": round(shape.sharded_weight_fraction, 3),
                "allreduce_ms": round(costs["allreduce"] * 1e3, 3),
                "broadcast_ms": round(costs["broadcast"] * 1e3, 3),
                "simulated_step_ms": round(predicted * 1e3, 2),
                "measured_step_ms": r["median_decode_step_ms"],
                "simulated_vs_measured": round(predicted / measured, 3),
            }
        )
        print(
            f"{r['model']:24s} TP {tp}: simulated step {predicted * 1e3:7.2f} ms, measured {measured * 1e3:7.2f} ms "
            f"(x{predicted / measured:.2f}; all-reduce {costs['allreduce'] * 1e3:.2f} ms, broadcast "
            f"{costs['broadcast'] * 1e3:.2f} ms)"
        )
    return out


def handoff_costs(tokens: int, repeats: int) -> list[dict]:
    """Per pair of sizes: links, bytes and wall time of one request's handoff (see the docstring)."""
    from common.protocol import KVLayout
    from testkit.kvtransfer import handoff, rank_group

    block_size, results = 16, []
    num_blocks = tokens // block_size
    for shape, src_tp, dst_tp in HANDOFF_PAIRS:
        layers, heads, head_dim = KV_SHAPES[shape]
        model = KVLayout(
            num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype="float32"
        )
        prefill = rank_group("shm", model, src_tp, num_blocks + 1)
        decode = rank_group("shm", model, dst_tp, num_blocks + 1, src_tp)
        try:
            for rank in prefill:
                rank.cache.normal_()
            ids = list(range(1, num_blocks + 1))
            seconds = []
            for i in range(repeats):
                started = time.perf_counter()
                links, received = handoff(prefill, decode, ids, ids, f"bench-{i}")
                seconds.append(time.perf_counter() - started)
                assert all(r.ok for r in received) and all(x.result.ok for x in links), (links, received)
        finally:
            for rank in prefill + decode:
                rank.close()
        total = sum(x.result.nbytes for x in links)
        results.append(
            {
                "kv_shape": shape,
                "prefill_tp": src_tp,
                "decode_tp": dst_tp,
                "tokens": tokens,
                "transfers": len(links),
                "total_bytes": total,
                "bytes_vs_tp1": round(total / model.block_bytes / num_blocks, 3),
                "links": [
                    {
                        "prefill_rank": x.link.src_rank,
                        "decode_rank": x.link.dst_rank,
                        "kv_heads": list(x.link.heads),
                        "bytes": x.result.nbytes,
                    }
                    for x in links
                ],
                "median_handoff_ms": round(statistics.median(seconds) * 1e3, 2),
            }
        )
        print(
            f"{shape:24s} TP {src_tp} -> {dst_tp}: {len(links)} transfers, {total / 2**20:.1f} MiB, "
            f"median {statistics.median(seconds) * 1e3:.2f} ms"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--handoff-tokens", type=int, default=1024)
    parser.add_argument("--out", default="bench/results/tp_step_cpu.json")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    started = time.time()
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(args.prompt_tokens)]
    steps: dict[tuple, list[float]] = {c: [] for c in CONFIGS}
    tokens: dict[tuple, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="baton-bench-tp-") as tmp:
        models = {"default": str(resolve_model_dir(quiet=True)), "smollm2_shape_12_heads": smollm2_shaped_model(tmp)}
        for _ in range(args.rounds):
            for config in CONFIGS:
                model, tp, threads = config
                job = GroupJob(models[model], [prompt], max_tokens=8, decode_steps_to_time=args.steps)
                [result] = run_group([job], tp, EngineConfig(num_threads=threads, kv_cache_memory=64 << 20))
                steps[config] += result.decode_step_seconds
                tokens[config] = result.token_ids[0]
                assert len(set(result.steps_run)) == 1, f"{config}: the ranks ran {result.steps_run} steps"
    results = []
    for config in CONFIGS:
        model, tp, threads = config
        timed = sorted(steps[config])
        median = statistics.median(timed)
        base = statistics.median(steps[(model, 1, 1)])
        results.append(
            {
                "model": model,
                "tensor_parallel_size": tp,
                "threads_per_rank": threads,
                "timed_steps": len(timed),
                "median_decode_step_ms": round(median * 1e3, 2),
                "p90_decode_step_ms": round(timed[int(0.9 * len(timed))] * 1e3, 2),
                "single_stream_tokens_per_s": round(1 / median, 1),
                "step_time_vs_tp1_1thread": round(median / base, 3),
                "greedy_tokens_equal_tp1": tokens[config] == tokens[(model, 1, 1)],
            }
        )
        print(
            f"{model:24s} TP {tp} x {threads} thread(s): median step {median * 1e3:7.2f} ms "
            f"({1 / median:6.1f} tokens/s, {len(timed)} steps, x{median / base:.2f} of TP 1)"
        )
    simulated = simulated_tp_steps(results)
    handoffs = handoff_costs(args.handoff_tokens, args.rounds * 5)
    out = {
        "bench": "bench/tp.py",
        "command": f"python -m bench.tp --steps {args.steps} --prompt-tokens "
        f"{args.prompt_tokens} --rounds {args.rounds} --handoff-tokens "
        f"{args.handoff_tokens}",
        "dtype": "float32",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "load_average_1m_at_start": round(load, 2),
        "wall_s": round(time.time() - started, 1),
        "note": "2-core machine: medians over interleaved rounds; TP > 1 here is a correctness target, not a speed "
        "claim (each decode step is 2 gloo all-reduces per layer over loopback TCP plus the step broadcast)",
        "results": results,
        "simulated": simulated,
        "handoffs": handoffs,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
