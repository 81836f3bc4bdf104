"""Tables of docs/tensor-parallel.md: the decode step per tensor-parallel size, measured and
simulated, and the KV handoff between groups of different sizes (bench/tp.py).

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

from docs.hooks.results import builders, f, load, ms, ratio, table


def t_tp_step() -> str:
    """bench/tp.py: single-stream decode step time per tensor-parallel size (medians of rank 0's steps)."""
    d = load("tp_step_cpu")
    names = {"default": "SmolLM2-135M", "smollm2_shape_12_heads": "SmolLM2-135M's shapes in 12 heads"}
    rows = [
        [
            names.get(r["model"], r["model"]),
            str(r["tensor_parallel_size"]),
            str(r["threads_per_rank"]),
            ms(r["median_decode_step_ms"]),
            f(r["single_stream_tokens_per_s"]),
            ratio(r["step_time_vs_tp1_1thread"]),
            "yes" if r["greedy_tokens_equal_tp1"] else "**no**",
        ]
        for r in d["results"]
    ]
    return table(
        [
            "model",
            "TP",
            "threads per rank",
            "decode step p50 (ms)",
            "tokens/s, one stream",
            "step time vs TP 1 on one thread",
            "greedy tokens equal TP 1",
        ],
        rows,
    ) + (
        f"\n\n`{d['command']}`, float32, {d['cpu_count']} cores, 1-minute load {d['load_average_1m_at_start']} "
        f"at the start."
    )


def t_tp_simulated() -> str:
    """bench/tp.py: the simulator's TP step (cluster.sim.costs.TensorParallelCost) against the measured one."""
    d = load("tp_step_cpu")
    names = {"default": "SmolLM2-135M", "smollm2_shape_12_heads": "SmolLM2-135M's shapes in 12 heads"}
    rows = [
        [
            names.get(r["model"], r["model"]),
            str(r["tensor_parallel_size"]),
            ms(r["tp1_step_ms"]),
            f(r["allreduce_ms"], 2),
            f(r["broadcast_ms"], 2),
            ms(r["simulated_step_ms"]),
            ms(r["measured_step_ms"]),
            ratio(r["simulated_vs_measured"]),
        ]
        for r in d["simulated"]
    ]
    return table(
        [
            "model",
            "TP",
            "TP 1 step (ms)",
            "all-reduce (ms)",
            "broadcast (ms)",
            "simulated step (ms)",
            "measured step (ms)",
            "simulated / measured",
        ],
        rows,
    )


def t_tp_handoff() -> str:
    """bench/tp.py: one request's KV handoff between prefill and decode groups of each pair of sizes."""
    d = load("tp_step_cpu")
    names = {"default": "SmolLM2-135M (3 KV heads)", "smollm2_shape_12_heads": "12-head shapes (4 KV heads)"}
    rows = [
        [
            names.get(r["kv_shape"], r["kv_shape"]),
            f"{r['prefill_tp']} -> {r['decode_tp']}",
            str(r["transfers"]),
            ", ".join(f"{x['prefill_rank']}->{x['decode_rank']}" for x in r["links"]),
            f(r["total_bytes"] / 2**20, 1),
            ratio(r["bytes_vs_tp1"]),
            ms(r["median_handoff_ms"]),
        ]
        for r in d["handoffs"]
    ]
    return table(
        [
            "KV shape",
            "prefill TP -> decode TP",
            "transfers",
            "rank pairs",
            "MiB moved",
            "bytes vs TP 1 -> 1",
            "handoff p50 (ms)",
        ],
        rows,
    ) + (f"\n\nOne request of {d['handoffs'][0]['tokens']} tokens, float32, shared memory, `{d['command']}`.")


TABLES = builders(globals())
