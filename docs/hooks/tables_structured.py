"""Tables of docs/structured-outputs.md: grammar-constrained serving and the validity of its replies.

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

from docs.hooks.results import builders, f, load, ratio, table


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


TABLES = builders(globals())
