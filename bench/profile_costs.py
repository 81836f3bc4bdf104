"""Profile this machine's engine steps and fit the simulator's cost model (cluster/sim/costs.py).

Runs the real engine (`workers.engine.llm_engine.LLMEngine`, the default model, one torch thread: what each
worker of a default `baton serve` gets on this 2-core machine) through prefills of 32-256 new
tokens over cached prefixes of 0-1,536 tokens, a 2,000-token prompt in 256-token chunks, decode
batches of 1-32 sequences at contexts of 32-1,024 tokens, and mixed steps. Every engine step is
recorded with its shape (the scheduler's chunks) and its wall time; a least-squares fit gives

    step = c0 + c_token * max(tokens, knee) + c_sampled * sampled + c_decode_ctx * decode_context
           + c_prefill_pairs * prefill_pairs + c_decode_seq * decode_seqs

(knee chosen by a 1-D search; coefficients kept >= 0). With --peer a second engine process keeps
decoding and prefilling meanwhile, as the other worker of a 1 + 1 deployment does part of the time.
With --served the steps are a real `baton serve --threads-per-worker 1`'s instead, logged by its
workers (BATON_STEP_LOG_DIR) under a profiling workload of this file's own (`served_workload`):
what the simulator's validation uses. Both workers' steps are then on one clock, so the fit also
gives how much a step slows while the other worker of the host computes
(cluster.sim.host.fit_host_contention: the coefficients are then a step's cost alone), and the
client's token times give the router's and the stream's overheads (cluster.sim.served_overheads). The
Ray call round trip is measured when --overheads is given (starts Ray on 127.0.0.1). Writes a
model profile that `baton plan --model-profile` and bench/sim_validate.py read:

    .venv/bin/python -m bench.profile_costs [--dtype float32] [--out bench/results/cost_profile_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from cluster.sim.costs import StepShape, fit_cost_model
from cluster.sim.host import fit_host_contention
from cluster.sim.served_overheads import served_overheads
from cluster.sim.workload import Client, SimRequest, Workload
from common.envs import ensure_private_ray_env
from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.shell.worker import STEP_LOG_ENV


class Recorder:
    """Records each engine step's shape and wall time (`LLMEngine.observe_steps`)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.samples: list[dict] = []
        self._label = ""
        engine.observe_steps(self._observe)

    def _observe(self, chunks: list[tuple[int, int, bool]], seconds: float) -> None:
        self.samples.append(sample(chunks, seconds, self._label))

    def step(self, label: str) -> None:
        self._label = label
        self.engine.step()

    def run_all(self, label: str, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.engine.has_unfinished_requests():
                return
            self.step(label)


def sample(chunks: list[tuple[int, int, bool]], seconds: float, label: str, **where) -> dict:
    """One fit sample: a step's shape (cluster.sim.costs.StepShape) and its wall seconds (`where`:
    a served step's worker and end on the host's monotonic clock)."""
    return {"label": label, "seconds": seconds, **where, **StepShape.of(chunks).__dict__}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def profile(engine: LLMEngine, rng: random.Random, quick: bool) -> list[dict]:
    rec = Recorder(engine)

    def greedy(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    # Warm-up (first calls allocate and pack).
    engine.add_request(tokens(rng, 64), greedy(4))
    rec.run_all("warmup")
    rec.samples.clear()
    # Prefill over cached prefixes.
    cached = (0, 512) if quick else (0, 512, 1536)
    new = (32, 256) if quick else (32, 96, 256)
    for c in cached:
        prefix = tokens(rng, c)
        if c:
            engine.add_request(prefix + tokens(rng, 1), greedy(1))
            rec.run_all("warm prefix")
        for n in new:
            for _ in range(2):
                engine.add_request(prefix + tokens(rng, n), greedy(1))
                rec.run_all(f"prefill {n} over {c} cached")
    # A long prompt in chunks.
    engine.add_request(tokens(rng, 1000 if quick else 2000), greedy(1))
    rec.run_all("long prompt chunks")
    # Decode batches.
    grid = (
        ((1, 32), (8, 256), (16, 32))
        if quick
        else ((1, 32), (1, 1024), (4, 256), (8, 32), (8, 256), (8, 1024), (16, 32), (16, 256), (32, 32), (32, 256))
    )
    for b, ctx in grid:
        for _ in range(b):
            engine.add_request(tokens(rng, ctx), greedy(10))
        rec.run_all(f"decode {b} x {ctx}")
    # Mixed: a batch decoding while a prompt is prefilled.
    for b in (8,) if quick else (4, 16):
        for _ in range(b):
            engine.add_request(tokens(rng, 64), greedy(24))
        for _ in range(6):
            rec.step(f"mixed {b}")
        engine.add_request(tokens(rng, 512), greedy(1))
        rec.run_all(f"mixed {b}")
    return rec.samples


def peer_load(dtype: str, threads: int, stop, ready) -> None:
    """The other worker of a 1 + 1 deployment, busy: an engine decoding 8 sequences and prefilling a
    256-token prompt now and then, until told to stop (a separate process, as the other actor is)."""
    engine = load_engine(None, EngineConfig(dtype=dtype, num_threads=threads, kv_cache_memory=256 << 20))
    rng = random.Random(1)
    ready.set()
    while not stop.is_set():
        while len(engine.request_ids()) < 8:
            engine.add_request(tokens(rng, 256), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        engine.step()


def served_workload(rng: random.Random) -> list[Workload]:
    """What --served sends, phase after phase: a warm-up; single requests to the idle server, 0.3 s
    apart (8 prefilled by the decode worker, 8 by the prefill worker: the overheads of a request's
    way in); prefills of 32-256 new tokens over cached prefixes of 0-1,536 (each prefix sent once
    before), beside 4 streams; decode batches of 1-16 sequences of 64-512 tokens; decode batches
    whose size and context vary apart (2 x 1,024, 8 x 64, 8 x 768, 16 x 256 tokens: the context's
    cost told from the rows'); 256-token prompts one at a time beside 1 stream and beside 16 (a
    neighbour stepping fast or slowly); 8 streams beside three 1,500-token prompts. Not the
    validation workloads (cluster.sim.validation)."""
    n = iter(range(1_000_000))

    def req(prompt, out, at=None):
        return SimRequest(f"profile-{next(n)}", tuple(prompt), out, at)

    warm = Workload((Client.closed_loop("warm-up", [req(tokens(rng, 64), 8) for _ in range(4)], 2),))
    one_by_one = [req(tokens(rng, 24 + i), 8) for i in range(8)] + [req(tokens(rng, 200 + i), 8) for i in range(8)]
    isolated = Workload((Client("isolated", (tuple(one_by_one),), 1, think_s=0.3),))
    units = []
    for cached in (0, 512, 1536):
        for new in (32, 96, 256):
            prefix = tokens(rng, cached)
            units.append((req(prefix + tokens(rng, 16), 4), req(prefix + tokens(rng, new), 8)))
    # Prefills run beside decoding streams, as a prefill worker's mostly do.
    prefixes = Workload(
        (
            Client("prefixes", tuple(units), 1),
            Client.closed_loop("streams", [req(tokens(rng, 32), 96) for _ in range(12)], 4),
        )
    )
    decodes = Workload(
        tuple(
            Client.closed_loop(f"decode {c}", [req(tokens(rng, rng.randrange(64, 513)), 64) for _ in range(2 * c)], c)
            for c in (1, 4, 8, 16)
        )
    )
    grid = [
        Workload((Client.closed_loop(f"{b} x {ctx}", [req(tokens(rng, ctx), 48) for _ in range(2 * b)], b),))
        for b, ctx in ((2, 1024), (8, 64), (8, 768), (16, 256))
    ]
    beside = [
        Workload(
            (
                Client.closed_loop("prompts", [req(tokens(rng, 256), 1) for _ in range(6)], 1),
                Client.closed_loop("streams", [req(tokens(rng, 32), out) for _ in range(b)], b),
            )
        )
        for b, out in ((1, 160), (16, 96))
    ]
    mixed = Workload(
        (
            Client.closed_loop("streams", [req(tokens(rng, 32), 192) for _ in range(8)], 8),
            Client.open_loop("long", [req(tokens(rng, 1500), 1, at) for at in (1.0, 4.0, 7.0)]),
        )
    )
    return [warm, isolated, prefixes, decodes, *grid, *beside, mixed]


def served_samples(args) -> tuple[list[dict], list[list[dict]], dict[str, list]]:
    """Every engine step of a real `baton serve` (bench/sim_validate.py's server and client) under
    served_workload, both workers' steps, the warm-up's left out; each later phase's requests with
    their tokens' arrival times; and each role's steps as (start, end, chunks), by start."""
    import asyncio
    import tempfile

    from bench import sim_validate  # only --served needs its server and client

    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as log_dir:

        def logs():
            return sorted(Path(log_dir).glob("*.jsonl"))

        # The server's workers inherit STEP_LOG_ENV.
        with sim_validate.baton_server(
            args.port, Path("/tmp/profile_costs_serve.log"), ("--dtype", args.dtype), env={STEP_LOG_ENV: log_dir}
        ):
            warm, *phases = served_workload(random.Random(args.seed))
            asyncio.run(sim_validate.run_real(warm, url, args.model))
            skip = {path: len(path.read_text().splitlines()) for path in logs()}
            rows = [asyncio.run(sim_validate.run_real(phase, url, args.model, token_times=True)) for phase in phases]
        samples, steps = [], {"prefill": [], "decode": []}
        for path in logs():
            for line in path.read_text().splitlines()[skip.get(path, 0) :]:
                step = json.loads(line)
                chunks = [tuple(c) for c in step["chunks"]]
                where = {"worker": path.stem, "end": step["end"]}
                samples.append(sample(chunks, step["seconds"], f"served {step['role']}", **where))
                steps[step["role"]].append((step["end"] - step["seconds"], step["end"], chunks))
    return samples, rows, {role: sorted(s) for role, s in steps.items()}


def measure_overheads() -> dict:
    """Ray actor call round trip on 127.0.0.1 (p50 of 200), as the router's calls to workers pay it."""
    ensure_private_ray_env()
    import ray  # only this measurement needs Ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:

        @ray.remote(num_cpus=0)
        class Echo:
            def ping(self, x):
                return x

        echo = Echo.remote()
        ray.get(echo.ping.remote(0))
        times = []
        for i in range(200):
            t0 = time.perf_counter()
            ray.get(echo.ping.remote(i))
            times.append(time.perf_counter() - t0)
        return {"rpc_s": statistics.median(times)}
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a default 1+1 `baton serve` here: 1)")
    ap.add_argument(
        "--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV cache per worker (serve's default)"
    )
    ap.add_argument("--overheads", action="store_true", help="also measure the Ray call round trip")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a test's profile, ~20 s)")
    ap.add_argument(
        "--peer",
        action="store_true",
        help="keep a second engine process busy meanwhile, as the other worker of a 1 + 1 `baton serve` "
        "is some of the time (tried once: it over-predicted the served steps 2-4x)",
    )
    ap.add_argument(
        "--served",
        action="store_true",
        help="fit the steps of a real `baton serve --threads-per-worker 1` (both workers, beside the "
        "router and the client) under a profiling workload, instead of an engine alone",
    )
    ap.add_argument("--port", type=int, default=8124, help="with --served: the server's port on 127.0.0.1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="with --served: the served model name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/cost_profile_cpu.json")
    args = ap.parse_args()
    started = time.perf_counter()
    served, served_rows, served_steps = served_samples(args) if args.served else (None, [], {})
    config = EngineConfig(dtype=args.dtype, num_threads=args.threads, kv_cache_memory=args.kv_cache_memory)
    engine = load_engine(None, config)
    peer = None
    if args.peer:
        ctx = multiprocessing.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        peer = ctx.Process(target=peer_load, args=(args.dtype, args.threads, stop, ready), daemon=True)
        peer.start()
        ready.wait(300)
    try:
        samples = served if served is not None else profile(engine, random.Random(args.seed), args.quick)
    finally:
        if peer is not None:
            stop.set()
            peer.join(30)
    contention = None
    if served is not None:  # both workers' steps, on one clock: fit how they slow each other too
        coefficients, knee, quality, contention = fit_host_contention(samples)
    else:
        coefficients, knee, quality = fit_cost_model(samples)
    bm = engine.block_manager
    mc = engine.model_config
    kv_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * (4 if args.dtype == "float32" else 2)
    overheads = {"router_s": 0.002, "rpc_s": 0.001, "stream_s": 0.0015, "heartbeat_s": 2.0}
    if args.overheads:
        overheads.update(measure_overheads())
    measured = None
    if served is not None:
        isolated = served_rows[0]
        measured = served_overheads(
            [r for phase in served_rows for r in phase],
            served_steps["prefill"],
            served_steps["decode"],
            overheads["rpc_s"],
            isolated,
        )
        overheads.update({k: measured[k] for k in ("router_s", "stream_s") if measured[k] is not None})
    result = {
        "cost_model": {
            "kind": "fitted",
            "coefficients": coefficients,
            "knee": knee,
            "kv_bytes_per_token": kv_bytes,
            "kv_capacity_tokens": bm.num_blocks * bm.block_size,
            "gpus_per_worker": 1,
        },
        "overheads": overheads,
        "host_contention": None if contention is None else dataclasses.asdict(contention),
        "link": "cpu-shm",
        "served_overheads": measured,
        "fit": quality,
        "peer_engine_busy": args.peer,
        "source": "a served `baton serve --threads-per-worker 1`'s steps" if args.served else "an engine alone",
        "engine": {
            "dtype": args.dtype,
            "threads": args.threads,
            "block_size": bm.block_size,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_blocks": bm.num_blocks,
        },
        "profile_seconds": time.perf_counter() - started,
        "machine": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python"] + sys.argv),
        "samples": samples,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("cost_model", "overheads", "fit", "profile_seconds")}, indent=2))


if __name__ == "__main__":
    main()
