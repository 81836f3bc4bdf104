"""Simulator vs a real `baton serve` on this machine: TTFT p50/p99 and TPOT p50 on five workloads.

Back to back, under the same conditions: (1) profile this machine's served engine steps and Ray call
(`bench/profile_costs.py --served`: the steps of a real server under a profiling workload of its
own, unless --profile names an existing profile), (2) for each workload start a fresh
`baton serve --threads-per-worker 1` (1 prefill + 1 decode worker, float32, one core each) on
127.0.0.1, send it the workload (cluster/sim/validation.py: the three the model was tuned on,
workload 1 and 2 of bench/compare_vllm.py and a multi-turn chat with a shared system prompt, and
two held out: Poisson arrivals of 512-token prompts, two closed-loop shapes at once) with
bench/serve.py's request code, stop it, (3) simulate the very same requests with the profiled
costs, and compare. Before the profile and before each server starts it waits for a quiet host
(bench.host_load: 1-minute load average below 0.6 for a minute, up to an hour), and records the
CPU others took during each run. Writes bench/results/sim_validate.json (and each real request's
times beside it, `*_requests.json`) and prints the table the docs show.

    .venv/bin/python -m bench.sim_validate                       # ~25 minutes on a quiet host
    .venv/bin/python -m bench.sim_validate --sim-only            # re-simulate the stored real runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

from bench import loadgen as load
from bench.host_load import CpuWatch, wait_for_quiet
from cluster.sim.validation import (
    TUNED_WORKLOADS,
    VALIDATION_WORKLOADS,
    compare,
    simulate,
    summarize,
    validation_workload,
)
from cluster.sim.workload import Workload
from common.envs import BATON_STEP_LOG_DIR
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
            sent = time.perf_counter() - start
            r = await load.one_request(client, args, list(req.prompt))
            rows.append(
                {
                    "request_id": req.request_id,
                    "sent_s": sent,
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
    lines = ["| workload | | metric | real (ms) | simulated (ms) | error |", "|---|---|---|---:|---:|---:|"]
    for name, entry in results.items():
        kind = "tuned" if entry.get("tuned", name in TUNED_WORKLOADS) else "held out"
        for row in entry["comparison"]:

            def fmt(v, spec):
                return "n/a" if v is None else format(v, spec)

            lines.append(
                f"| {name} | {kind} | {row['metric']} | {fmt(row['real_ms'], ',.0f')} | "
                f"{fmt(row['sim_ms'], ',.0f')} | {fmt(row['relative_error'], '+.1%')} |"
            )
    return "\n".join(lines)


def run_workload(name: str, port: int, model: str, step_log_dir: Path | None) -> tuple[dict, list[dict]]:
    """One real run on a fresh server, once the host is quiet: summarize()'s figures, the host's
    load meanwhile, and each request's row."""
    quiet = wait_for_quiet()
    env = None
    if step_log_dir is not None:
        shutil.rmtree(step_log_dir / name, ignore_errors=True)
        (step_log_dir / name).mkdir(parents=True)
        env = {BATON_STEP_LOG_DIR.name: str(step_log_dir / name)}
    # A fresh server per workload, as each simulation starts from an empty cluster (a server
    # that ran the others first holds their blocks, its pages scattered).
    with baton_server(port, Path("/tmp/sim_validate_serve.log"), env=env) as server:
        watch = CpuWatch([os.getpid(), server.process.pid])
        watch.start()
        t0 = time.perf_counter()
        rows = asyncio.run(run_real(validation_workload(name), f"http://127.0.0.1:{port}", model))
        wall = time.perf_counter() - t0
        host = watch.stop()
    real = {
        **summarize(rows),
        "wall_s": wall,
        "errors": sorted({r["error"] for r in rows if not r["ok"]})[:5],
        "host": {"quiet_wait": quiet, **host},
    }
    return real, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="an existing model profile (default: profile now)")
    ap.add_argument(
        "--profile-out", default="bench/results/cost_profile_cpu.json", help="where a profile taken now goes"
    )
    ap.add_argument("--sim-only", action="store_true", help="re-simulate against the real results stored in --out")
    ap.add_argument("--workloads", default=",".join(VALIDATION_WORKLOADS))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="bench/results/sim_validate.json")
    ap.add_argument(
        "--step-log-dir",
        default="/tmp/sim_validate_steps",
        help="each real run's servers log every engine step under DIR/<workload>/ (BATON_STEP_LOG_DIR); '' for none",
    )
    args = ap.parse_args()
    names = args.workloads.split(",")
    out = Path(args.out)
    profile = Path(args.profile or args.profile_out)
    if args.sim_only:
        stored = json.loads(out.read_text())
        real = {n: stored["results"][n]["real"] for n in names}
        extra = {k: stored[k] for k in ("real_run", "machine") if k in stored}
    else:
        if args.profile is None:
            profile_quiet = wait_for_quiet()
            subprocess.run(
                [sys.executable, "-m", "bench.profile_costs", "--served", "--overheads", "--out", str(profile)],
                check=True,
                cwd=ROOT,
            )
        real, requests, started = {}, {}, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        step_logs = Path(args.step_log_dir) if args.step_log_dir else None
        for name in names:
            real[name], requests[name] = run_workload(name, args.port, args.model, step_logs)
            print(f"real {name}: {json.dumps(real[name])}", flush=True)
        out.with_name(out.stem + "_requests.json").write_text(json.dumps(requests, indent=1) + "\n")
        extra = {
            "real_run": {
                "started": started,
                "server": "baton serve --port PORT "
                + " ".join(SERVER_FLAGS)
                + " (otherwise defaults: 1 prefill + 1 decode worker, float32)",
            },
            "machine": {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "load_average_1m": os.getloadavg()[0],
                "profile_quiet_wait": profile_quiet if args.profile is None else None,
            },
        }
    results = {}
    for name in names:
        sim = simulate(name, profile)
        results[name] = {
            "tuned": name in TUNED_WORKLOADS,
            "real": real[name],
            "sim": sim,
            "comparison": compare(real[name], sim),
        }
    report = {
        "benchmark": "sim_validate",
        "profile": str(profile),
        "tolerance": 0.2,
        "tuned_workloads": [n for n in names if n in TUNED_WORKLOADS],
        "held_out_workloads": [n for n in names if n not in TUNED_WORKLOADS],
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
