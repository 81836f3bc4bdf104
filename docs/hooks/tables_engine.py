"""Tables of docs/performance.md about the CPU engine's step: where a decode and a prefill step spend
their time, the sampler's cost, FP8's accuracy and memory, the AMX linear kernel.

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

from docs.hooks.results import builders, f, load, ms, pct, ratio, table


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


TABLES = builders(globals())
