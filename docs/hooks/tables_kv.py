"""Tables of docs/performance.md about the KV handoff: transfer bandwidth on one node and across
nodes, and what the per-block checksums cost.

Each `t_NAME` builds the table that `<!-- table: NAME -->` asks for, from bench/results/*.json
(docs/hooks/tables.py collects them).
"""

from __future__ import annotations

from docs.hooks.results import builders, f, gb, load, pct, size, table

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


TABLES = builders(globals())
