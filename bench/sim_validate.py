"""Simulator vs a real `baton serve` on this machine: TTFT p50/p99 and TPOT p50 on three workloads.

Back to back, under the same conditions: (1) profile this machine's served engine steps and Ray call
(`bench/profile_costs.py --served`: the steps of a real server under a profiling workload of its
own, unless --profile names an existing profile), (2) for each of the three workloads start a fresh
`baton serve --threads-per-worker 1` (1 prefill + 1 decode worker, float32, one core each) on
127.0.0.1, send it the workload (cluster/sim/validation.py: workload 1 and 2 of
bench/compare_vllm.py, and a multi-turn chat with a shared system prompt) with bench/serve.py's
request code, stop it, (3) simulate the very same requests with the profiled costs, and compare.
Writes bench/results/sim_validate.json and prints the table the README shows.

    .venv/bin/python -m bench.sim_validate                       # ~4 minutes
    .venv/bin/python -m bench.sim_validate --profile bench/results/cost_profile_cpu.json --sim-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

from bench import loadgen as load
from cluster.sim.validation import VALIDATION_WORKLOADS, compare, simulate, summarize, validation_workload
from cluster.sim.workload import Workload
from testkit.harness import baton_serve


async def run_real(workload: Workload, base_url: str, model: str) -> list[dict]:
    """Send a Workload to a server as the simulator does: units in order, `concurrency` units at once,
    open-loop requests at their arrival times."""
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=128)) as client:
        start = time.perf_counter()

        async def send(req) -> None:
            args = load.parser().parse_args(
                ["--model", model, "--token-ids", "--ignore-eos", "--output-len", str(req.output_len)]
            )
            args.endpoint = "/v1/completions"
            r = await load.one_request(client, args, list(req.prompt))
            rows.append(
                {
                    "request_id": req.request_id,
                    "ok": r.ok,
                    "ttft_s": r.ttft_s,
                    "tpot_s": r.tpot_s,
                    "tokens": r.output_tokens,
                    "error": r.error,
                }
            )

        async def run_unit(unit) -> None:
            for req in unit:
                if req.arrival_s is not None:
                    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
                await send(req)

        async def run_client(c) -> None:
            sem = asyncio.Semaphore(c.concurrency or len(c.units))

            async def gated(unit):
                async with sem:
                    await run_unit(unit)

            await asyncio.gather(*(gated(u) for u in c.units))

        await asyncio.gather(*(run_client(c) for c in workload.clients))
    return rows


# One core per worker, as the profile times them (on this 2-core machine also what the default
# split of the cores between the workers gives, cluster.config.BatonConfig.worker_threads).
SERVER_FLAGS = ("--threads-per-worker", "1")


def baton_server(port: int, log_path: Path, extra_flags: tuple[str, ...] = (), env: dict | None = None):
    """`baton serve` with SERVER_FLAGS on `port` until the block ends (testkit.harness.baton_serve)."""
    return baton_serve(["--log-level", "warning", *SERVER_FLAGS, *extra_flags], port=port, log_path=log_path, env=env)


def table(results: dict) -> str:
    lines = ["| workload | metric | real (ms) | simulated (ms) | error |", "|---|---|---:|---:|---:|"]
    for name, entry in results.items():
        for row in entry["comparison"]:

            def fmt(v, spec):
                return "n/a" if v is None else format(v, spec)

            lines.append(
                f"| {name} | {row['metric']} | {fmt(row['real_ms'], ',.0f')} | {fmt(row['sim_ms'], ',.0f')} | "
                f"{fmt(row['relative_error'], '+.1%')} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="an existing model profile (default: profile now)")
    ap.add_argument("--sim-only", action="store_true", help="re-simulate against the real results stored in --out")
    ap.add_argument("--workloads", default=",".join(VALIDATION_WORKLOADS))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="bench/results/sim_validate.json")
    args = ap.parse_args()
    names = args.workloads.split(",")
    out = Path(args.out)
    profile = Path(args.profile or "bench/results/cost_profile_cpu.json")
    if args.sim_only:
        stored = json.loads(out.read_text())
        real = {n: stored["results"][n]["real"] for n in names}
        extra = {k: stored[k] for k in ("real_run", "machine") if k in stored}
    else:
        if args.profile is None:
            subprocess.run(
                [sys.executable, "-m", "bench.profile_costs", "--served", "--overheads", "--out", str(profile)],
                check=True,
                cwd=ROOT,
            )
        real, started = {}, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for name in names:
            # A fresh server per workload, as each simulation starts from an empty cluster (a server
            # that ran the others first holds their blocks, its pages scattered).
            with baton_server(args.port, Path("/tmp/sim_validate_serve.log")):
                t0 = time.perf_counter()
                rows = asyncio.run(run_real(validation_workload(name), f"http://127.0.0.1:{args.port}", args.model))
                real[name] = {
                    **summarize(rows),
                    "wall_s": time.perf_counter() - t0,
                    "errors": sorted({r["error"] for r in rows if not r["ok"]})[:5],
                }
                print(f"real {name}: {json.dumps(real[name])}", flush=True)
        extra = {
            "real_run": {
                "started": started,
                "server": "baton serve --port PORT "
                + " ".join(SERVER_FLAGS)
                + " (otherwise defaults: 1 prefill + 1 decode worker, float32)",
            },
            "machine": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        }
    results = {}
    for name in names:
        sim = simulate(name, profile)
        results[name] = {"real": real[name], "sim": sim, "comparison": compare(real[name], sim)}
    report = {
        "benchmark": "sim_validate",
        "profile": str(profile),
        "tolerance": 0.2,
        "all_within": all(r["within"] for e in results.values() for r in e["comparison"]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python"] + sys.argv),
        **extra,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    print("all within 20%:", report["all_within"])


if __name__ == "__main__":
    main()
