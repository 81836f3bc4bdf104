"""The three validation workloads, as the simulator sees them, and the sim-vs-real comparison.

bench/sim_validate.py sends the same requests to a real `baton serve` (bench/serve.py's client)
and simulates them here; tests/sim/test_validation.py re-simulates the stored run in `make test`.

1. `throughput` (bench/compare_vllm.py workload 1): 64 prompts of 256 token ids, 128 output tokens,
   16 at a time.
2. `mixed` (workload 2): 24 streams (32 in / 256 out, 8 at a time) while a second client sends
   10 prompts of 2,000 tokens for 1 output token, Poisson at 0.25 per second.
3. `chat`: multi-turn conversations sharing a system prompt; each turn's prompt is the previous
   turn's prompt, a fixed assistant reply and a new user message (token ids, so the real run and
   the simulation send identical prompts).
4. `poisson512` (held out): open loop, 72 prompts of 512 tokens at Poisson arrivals of 0.5 per
   second, 64 output tokens each (the prefill worker busy about 60% of the time: a 512-token
   prompt is two 256-token chunks of about 0.6 s on its core).
5. `two_shapes` (held out): two closed-loop clients at once, 40 requests of 128 in / 128 out, 4 at
   a time, beside 16 of 1,024 in / 32 out, 2 at a time.

The first three are `TUNED_WORKLOADS`: the model's choices were made looking at them. The other
two (`HELD_OUT_WORKLOADS`) were only ever compared, never tuned on.

Prompts and arrival times are drawn exactly as bench/serve.py draws them (same seeds, same order
of random calls), so the simulated requests are the very ones the real client sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.config import BatonConfig
from cluster.sim.costs import load_cost_model
from cluster.sim.engine import EngineSettings
from cluster.sim.host import load_host_contention
from cluster.sim.simulator import ClusterSpec, Simulator
from cluster.sim.workload import Client, SimRequest, Workload
from common.stats import summary as latency_summary

__all__ = [
    "ChatShape",
    "HELD_OUT_WORKLOADS",
    "SPEC",
    "TUNED_WORKLOADS",
    "VALIDATION_WORKLOADS",
    "chat_conversations",
    "compare",
    "serve_requests",
    "served_spec",
    "simulate",
    "summarize",
    "validation_workload",
]

TUNED_WORKLOADS = ("throughput", "mixed", "chat")
HELD_OUT_WORKLOADS = ("poisson512", "two_shapes")
VALIDATION_WORKLOADS = TUNED_WORKLOADS + HELD_OUT_WORKLOADS
METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"))


def serve_requests(
    name: str, input_len: int, output_len: int, num_prompts: int, seed: int, request_rate: float | None = None
) -> list[SimRequest]:
    """bench/serve.py --token-ids: the prompts it sends, and with --request-rate the send times."""
    rng = random.Random(seed)
    shared: list[int] = []  # --shared-prefix-len 0
    prompts = [shared + [rng.randrange(1000, 40000) for _ in range(input_len)] for _ in range(num_prompts)]
    arrivals: list[float | None] = [None] * num_prompts
    if request_rate:
        t = 0.0
        for i in range(num_prompts):
            arrivals[i] = t  # the client sends, then sleeps expovariate(rate) before the next
            t += rng.expovariate(request_rate)
    return [SimRequest(f"{name}-{i}", tuple(p), output_len, arrivals[i]) for i, p in enumerate(prompts)]


@dataclass(frozen=True)
class ChatShape:
    conversations: int = 6
    turns: int = 4
    concurrency: int = 3
    system_len: int = 384
    user_len: int = 48
    reply_len: int = 32  # the assistant reply kept in the history (fixed tokens)
    output_len: int = 32
    seed: int = 7


def chat_conversations(shape: ChatShape = ChatShape()) -> list[list[list[int]]]:
    """Per conversation, each turn's prompt (token ids)."""
    rng = random.Random(shape.seed)

    def draw(n):
        return [rng.randrange(1000, 40000) for _ in range(n)]

    system = draw(shape.system_len)
    out = []
    for _ in range(shape.conversations):
        history = system + draw(shape.user_len)
        turns = [list(history)]
        for _ in range(shape.turns - 1):
            history = history + draw(shape.reply_len) + draw(shape.user_len)
            turns.append(list(history))
        out.append(turns)
    return out


def validation_workload(name: str, chat: ChatShape = ChatShape()) -> Workload:
    if name == "throughput":
        return Workload((Client.closed_loop("throughput", serve_requests("w1", 256, 128, 64, 0), 16),))
    if name == "mixed":
        streams = serve_requests("streams", 32, 256, 24, 1)
        longs = serve_requests("longs", 2000, 1, 10, 2, request_rate=0.25)
        return Workload((Client.closed_loop("streams", streams, 8), Client.open_loop("long_prompts", longs)))
    if name == "chat":
        units = tuple(
            tuple(SimRequest(f"chat-{c}-{t}", tuple(p), chat.output_len) for t, p in enumerate(turns))
            for c, turns in enumerate(chat_conversations(chat))
        )
        return Workload((Client("chat", units, chat.concurrency),))
    if name == "poisson512":
        return Workload((Client.open_loop("poisson", serve_requests("p512", 512, 64, 72, 3, request_rate=0.5)),))
    if name == "two_shapes":
        short = serve_requests("short", 128, 128, 40, 4)
        long = serve_requests("long", 1024, 32, 16, 5)
        return Workload((Client.closed_loop("short", short, 4), Client.closed_loop("long", long, 2)))
    raise ValueError(f"unknown validation workload {name!r}; known: {', '.join(VALIDATION_WORKLOADS)}")


def compare(real: dict, simulated: dict, tolerance: float = 0.2) -> list[dict]:
    """Rows of (metric, real, simulated, relative error, within tolerance) from two summaries
    shaped as summarize()'s (ttft_ms / tpot_ms percentiles, in ms)."""
    rows = []
    for metric, q in METRICS:
        r, s = real[metric][q], simulated[metric][q]
        err = (s - r) / r if r and s is not None else None
        rows.append(
            {
                "metric": f"{metric.split('_')[0].upper()} {q}",
                "real_ms": r,
                "sim_ms": s,
                "relative_error": err,
                "within": err is not None and abs(err) <= tolerance,
            }
        )
    return rows


def served_spec(config: BatonConfig | None = None, device: str = "cpu") -> ClusterSpec:
    """The deployment `baton serve` runs with `config` (default: its defaults), as the launcher
    builds it: the pools' sizes, the engine's scheduling knobs, and the routing with its automatic
    prefill queue threshold set for the prefill pool's `device` (cluster.launcher.deploy:
    `RoutingConfig.for_device`; on a CPU, past 1,024 queued prompt tokens the decode worker prefills
    a prompt itself). With LoRA enabled, the workers' adapter slots and host copies. The routing's
    seed is fixed so the simulation is repeatable."""
    config = config or BatonConfig()
    e, p = config.engine, config.placement
    engine = EngineSettings(
        e.block_size,
        e.max_num_seqs,
        e.max_num_batched_tokens,
        e.enable_prefix_caching,
        scheduling_policy=e.scheduling_policy,
    )
    if e.lora_enabled:
        engine = replace(engine, max_loras=e.max_loras, max_cpu_loras=e.max_cpu_loras)
    routing = replace(config.routing.for_device(device), seed=0)
    return ClusterSpec(p.prefill_workers, p.decode_workers, engine, routing)


SPEC = served_spec()  # what bench/sim_validate.py's `baton serve --threads-per-worker 1` runs


def summarize(rows: list[dict]) -> dict:
    """rows: {ok, ttft_s, tpot_s}: counts, and TTFT / TPOT as common.stats.summary gives them (ms)."""
    done = [r for r in rows if r["ok"]]
    return {
        "requests": len(rows),
        "completed": len(done),
        "ttft_ms": latency_summary([r["ttft_s"] for r in done]),
        "tpot_ms": latency_summary([r["tpot_s"] for r in done if r["tpot_s"] is not None]),
    }


def simulate(name: str, profile: str | Path, reverse_clients: bool = False) -> dict:
    """The validation workload `name` simulated on SPEC with the model profile at `profile`:
    summarize()'s figures, the routes taken, and the simulation's wall time. `reverse_clients`:
    the clients send their first requests in the reverse order (requests that arrive together
    reach the router in the order the clients are listed)."""
    cost, overheads, link = load_cost_model(profile)
    # Both workers of `baton serve` run on this one host: their steps slow each other's.
    host = load_host_contention(profile)
    workload = validation_workload(name)
    if reverse_clients:
        workload = Workload(tuple(reversed(workload.clients)))
    result = Simulator(SPEC, cost, overheads, link, host=host).run(workload)
    rows = [{"ok": r.completed, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s} for r in result.records]
    return {**summarize(rows), "routes": result.summary()["routes"], "simulation_wall_s": result.sim_wall_s}
