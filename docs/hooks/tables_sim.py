"""Tables of docs/sim.md and docs/scale.md: the simulator against measured runs, the planner, the
simulated autoscaler, the 1,000-GPU sizing and several routers.

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

from docs.hooks.results import builders, f, load, ms, pct, ratio, table

# -- simulator -----------------------------------------------------------------------------------


def t_sim_validate() -> str:
    d = load("sim_validate")
    names = {
        "throughput": "1. throughput (256 in / 128 out, 64 prompts, 16 at a time)",
        "mixed": "2. mixed (24 streams 32/256, 8 at a time, + 10 prompts of 2,000 tokens at 0.25/s)",
        "chat": "3. multi-turn chat (6 conversations x 4 turns, 3 at a time)",
        "poisson512": "4. held out: Poisson arrivals (72 prompts of 512 / 64 at 0.5/s)",
        "two_shapes": "5. held out: two closed-loop shapes (128/128, 4 at a time, + 1,024/32, 2 at a time)",
    }
    metrics = ("TTFT p50", "TTFT p99", "TPOT p50")
    rows = []
    for key, r in d["results"].items():
        by = {c["metric"]: c for c in r["comparison"]}
        rows.append(
            [names.get(key, key)]
            + [
                f"{ms(by[m]['real_ms'])} / {ms(by[m]['sim_ms'])} ms ({pct(by[m]['relative_error'], 0, sign=True)})"
                + ("" if by[m]["within"] else " **over 20%**")
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


TABLES = builders(globals())
