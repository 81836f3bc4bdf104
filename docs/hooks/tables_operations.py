"""Tables of docs/operations.md: what a migration costs, the CPU autoscaler's run, the soak and
overload runs.

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

from docs.hooks.results import builders, f, load, ms, pct, table


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


TABLES = builders(globals())
