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
from cluster.sim.served_overheads import served_routes
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


async def run_real(workload: Workload, base_url: str, model: str, token_times: bool = False) -> list[dict]:
    """Send a Workload to a server as the simulator does: units in order, `concurrency` units at once,
    open-loop requests at their arrival times, a unit's requests `think_s` apart. With `token_times`,
    each row also has its prompt's length and when each token arrived (time.perf_counter: the
    host's monotonic clock, the workers' step logs' too)."""
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=128)) as client:
        start = time.perf_counter()

        async def send(req) -> None:
            args = load.parser().parse_args(
                ["--model", model, "--token-ids", "--ignore-eos", "--output-len", str(req.output_len)]
            )
            args.endpoint = "/v1/completions"
            sent = time.perf_counter()  # CLOCK_MONOTONIC, as the workers' step logs' `end`
            r = await load.one_request(client, args, list(req.prompt))
            rows.append(
                {
                    "request_id": req.request_id,
                    "sent_s": sent - start,
                    "sent_monotonic": sent,
                    "ok": r.ok,
                    "ttft_s": r.ttft_s,
                    "tpot_s": r.tpot_s,
                    "tokens": r.output_tokens,
                    "error": r.error,
                }
            )
            if token_times:
                times = [sent + r.ttft_s] if r.ok else []
                for gap in r.itl_s if r.ok else ():
                    times.append(times[-1] + gap)
                rows[-1].update(prompt_len=len(req.prompt), token_times=times)

        async def run_unit(unit, think_s: float) -> None:
            for i, req in enumerate(unit):
                if req.arrival_s is not None:
                    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
                elif i and think_s:
                    await asyncio.sleep(think_s)
                await send(req)

        async def run_client(c) -> None:
            sem = asyncio.Semaphore(c.concurrency or len(c.units))

            async def gated(unit):
                async with sem:
                    await run_unit(unit, c.think_s)

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
    """The comparison as a Markdown table: pooled real figure, each real run's, the simulation's."""
    lines = [
        "| workload | | metric | real (ms) | each run (ms) | simulated (ms) | error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    for name, entry in results.items():
        kind = "tuned" if entry.get("tuned", name in TUNED_WORKLOADS) else "held out"
        for row in entry["comparison"]:
            metric, q = row["metric"].split()
            runs = " / ".join(fmt(run[f"{metric.lower()}_ms"][q], ",.0f") for run in entry["real"].get("runs", []))
            lines.append(
                f"| {name} | {kind} | {row['metric']} | {fmt(row['real_ms'], ',.0f')} | {runs or '-'} | "
                f"{fmt(row['sim_ms'], ',.0f')} | {fmt(row['relative_error'], '+.1%')} |"
            )
    return "\n".join(lines)


def run_workload(name: str, port: int, model: str, step_log_dir: Path | None) -> tuple[dict, list[dict]]:
    """One real run on a fresh server, once the host is quiet: summarize()'s figures, the host's
    load meanwhile, the router's routing decisions, and each request's row."""
    quiet = wait_for_quiet()
    env = None
    if step_log_dir is not None:
        shutil.rmtree(step_log_dir, ignore_errors=True)
        step_log_dir.mkdir(parents=True)
        env = {BATON_STEP_LOG_DIR.name: str(step_log_dir)}
    # A fresh server per workload, as each simulation starts from an empty cluster (a server
    # that ran the others first holds their blocks, its pages scattered).
    with baton_server(port, Path("/tmp/sim_validate_serve.log"), env=env) as server:
        watch = CpuWatch([os.getpid(), server.process.pid])
        watch.start()
        t0 = time.perf_counter()
        rows = asyncio.run(run_real(validation_workload(name), f"http://127.0.0.1:{port}", model))
        wall = time.perf_counter() - t0
        host = watch.stop()
        routes = served_routes(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text)
    real = {
        **summarize(rows),
        "wall_s": wall,
        "errors": sorted({r["error"] for r in rows if not r["ok"]})[:5],
        "routes": routes,
        "host": {"quiet_wait": quiet, **host},
    }
    return real, rows


def pooled(runs: list[tuple[dict, list[dict]]]) -> dict:
    """The real side of a workload run `len(runs)` times, each on a fresh server: summarize()'s
    figures over every run's requests together (the server's percentiles vary from run to run by
    more than the tolerance on some workloads; pooling runs halves that noise), and each run's own."""
    rows = [r for _, run_rows in runs for r in run_rows]
    return {
        **summarize(rows),
        "wall_s": sum(real["wall_s"] for real, _ in runs),
        "errors": sorted({e for real, _ in runs for e in real["errors"]})[:5],
        "runs": [
            {k: real[k] for k in ("ttft_ms", "tpot_ms", "completed", "wall_s", "routes", "host")} for real, _ in runs
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="an existing model profile (default: profile now)")
    ap.add_argument(
        "--profile-out", default="bench/results/cost_profile_cpu.json", help="where a profile taken now goes"
    )
    ap.add_argument("--sim-only", action="store_true", help="re-simulate against the real results stored in --stored")
    ap.add_argument("--stored", default=None, help="the stored real runs --sim-only compares with (default: --out)")
    ap.add_argument(
        "--client-order",
        choices=("as-drawn", "reversed"),
        default="as-drawn",
        help="the order the simulated clients send their first requests in at time 0",
    )
    ap.add_argument("--workloads", default=",".join(VALIDATION_WORKLOADS))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="bench/results/sim_validate.json")
    ap.add_argument(
        "--step-log-dir",
        default="/tmp/sim_validate_steps",
        help="every real run's engine steps go to DIR/<workload>/<run>/ (BATON_STEP_LOG_DIR); '' for none",
    )
    ap.add_argument(
        "--runs", type=int, default=2, help="real runs of each workload, each on a fresh server; compared pooled"
    )
    args = ap.parse_args()
    names = args.workloads.split(",")
    out = Path(args.out)
    profile = Path(args.profile or args.profile_out)
    if args.sim_only:
        stored = json.loads(Path(args.stored or out).read_text())
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
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        step_logs = Path(args.step_log_dir) if args.step_log_dir else None
        runs: dict[str, list[tuple[dict, list[dict]]]] = {name: [] for name in names}
        for k in range(args.runs):  # the workloads in turn, so a slow drift of the host touches all alike
            for name in names:
                logs = None if step_logs is None else step_logs / name / str(k)
                runs[name].append(run_workload(name, args.port, args.model, logs))
                print(f"real {name} run {k}: {json.dumps(runs[name][-1][0])}", flush=True)
        real = {name: pooled(runs[name]) for name in names}
        requests = {name: [dict(r, run=k) for k, (_, rows) in enumerate(runs[name]) for r in rows] for name in names}
        out.with_name(out.stem + "_requests.json").write_text(json.dumps(requests, indent=1) + "\n")
        extra = {
            "real_run": {
                "started": started,
                "server": "baton serve --port PORT "
                + " ".join(SERVER_FLAGS)
                + " (otherwise defaults: 1 prefill + 1 decode worker, float32)",
                "runs_per_workload": args.runs,
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
        sim = simulate(name, profile, reverse_clients=args.client_order == "reversed")
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
        "client_order": args.client_order,
        **extra,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    print("all within 20%:", report["all_within"])


if __name__ == "__main__":
    main()
