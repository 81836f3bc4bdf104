"""Simulator vs a real `baton serve` on this machine: TTFT p50/p99 and TPOT p50 on three workloads.

Back to back, under the same conditions: (1) profile this machine's served engine steps and Ray call
(`bench/profile_costs.py --served`: the steps of a real server under a profiling workload of its
own, unless --profile names an existing profile), (2) for each of the three workloads start a fresh
`baton serve --threads-per-worker 1` (1 prefill + 1 decode worker, float32, one core each) on
127.0.0.1, send it the workload (cluster/sim/validation.py: workload 1 and 2 of
bench/compare_vllm.py, and a multi-turn chat with a shared system prompt) with bench/serve.py's
request code, stop it, (3) simulate the very same requests with the profiled costs, and compare.
Writes bench/results/sim_validate.json and prints the table the README shows.

    .venv/bin/python bench/sim_validate.py                       # ~4 minutes
    .venv/bin/python bench/sim_validate.py --profile bench/results/cost_profile_cpu.json --sim-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serve as load  # noqa: E402  (bench/serve.py: the request code every benchmark here uses)

from cluster.sim import ClusterSpec, EngineSettings, Simulator, load_cost_model  # noqa: E402
from cluster.sim.metrics import percentiles  # noqa: E402
from cluster.sim.validation import VALIDATION_WORKLOADS, compare, validation_workload  # noqa: E402
from cluster.sim.workload import Workload  # noqa: E402
from router.routing import RoutingConfig  # noqa: E402

SPEC = ClusterSpec(1, 1, EngineSettings(block_size=16, max_num_seqs=64, max_num_batched_tokens=256),
                   RoutingConfig(seed=0))  # `baton serve`'s defaults


def summarize(rows: list[dict]) -> dict:
    """rows: {ok, ttft_s, tpot_s}; bench/serve.py's percentiles."""
    done = [r for r in rows if r["ok"]]
    return {"requests": len(rows), "completed": len(done),
            "ttft_ms": percentiles([r["ttft_s"] for r in done]),
            "tpot_ms": percentiles([r["tpot_s"] for r in done if r["tpot_s"] is not None])}


async def run_real(workload: Workload, base_url: str, model: str) -> list[dict]:
    """Send a Workload to a server as the simulator does: units in order, `concurrency` units at once,
    open-loop requests at their arrival times."""
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=128)) as client:
        start = time.perf_counter()

        async def send(req) -> None:
            args = load.parser().parse_args(["--model", model, "--token-ids", "--ignore-eos",
                                             "--output-len", str(req.output_len)])
            args.endpoint = "/v1/completions"
            r = await load.one_request(client, args, list(req.prompt))
            rows.append({"request_id": req.request_id, "ok": r.ok, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
                         "tokens": r.output_tokens, "error": r.error})

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


# One core per worker, as the profile times them: without it the two workers share the machine's
# cores (cluster.placement.shared_cpu_host: a long prompt's prefill takes both, the decode worker
# runs at idle priority), a CPU-only arrangement the simulator, built for a worker per GPU, leaves out.
SERVER_FLAGS = ("--threads-per-worker", "1")


def start_server(port: int, log_path: Path, extra_flags: tuple[str, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    log = open(log_path, "w")
    proc = subprocess.Popen([str(ROOT / ".venv/bin/baton"), "serve", "--port", str(port), "--log-level", "warning",
                             *SERVER_FLAGS, *extra_flags],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"baton serve exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"baton serve not healthy after 300 s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        # To the server alone: it stops its workers and Ray (a group-wide signal stops them first,
        # and the shutdown then waits on them).
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def simulate(name: str, profile: Path) -> dict:
    cost, overheads, link = load_cost_model(profile)
    sim = Simulator(SPEC, cost, overheads, link)
    result = sim.run(validation_workload(name))
    rows = [{"ok": r.completed, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s} for r in result.records]
    return {**summarize(rows), "routes": result.summary()["routes"], "simulation_wall_s": result.sim_wall_s}


def table(results: dict) -> str:
    lines = ["| workload | metric | real (ms) | simulated (ms) | error |", "|---|---|---:|---:|---:|"]
    for name, entry in results.items():
        for row in entry["comparison"]:
            fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
            lines.append(f"| {name} | {row['metric']} | {fmt(row['real_ms'], ',.0f')} | {fmt(row['sim_ms'], ',.0f')} | "
                         f"{fmt(row['relative_error'], '+.1%')} |")
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
            subprocess.run([sys.executable, str(ROOT / "bench/profile_costs.py"), "--served", "--overheads",
                            "--out", str(profile)], check=True, cwd=ROOT)
        real, started = {}, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for name in names:
            # A fresh server per workload, as each simulation starts from an empty cluster (a server
            # that ran the others first holds their blocks, its pages scattered).
            proc = start_server(args.port, Path("/tmp/sim_validate_serve.log"))
            try:
                t0 = time.perf_counter()
                rows = asyncio.run(run_real(validation_workload(name), f"http://127.0.0.1:{args.port}", args.model))
                real[name] = {**summarize(rows), "wall_s": time.perf_counter() - t0,
                              "errors": sorted({r["error"] for r in rows if not r["ok"]})[:5]}
                print(f"real {name}: {json.dumps(real[name])}", flush=True)
            finally:
                stop_server(proc)
        extra = {"real_run": {"started": started, "server": "baton serve --port PORT " + " ".join(SERVER_FLAGS) +
                              " (otherwise defaults: 1 prefill + 1 decode worker, float32)"},
                 "machine": {"machine": platform.machine(), "cpus": os.cpu_count(),
                             "load_average_1m": os.getloadavg()[0]}}
    results = {}
    for name in names:
        sim = simulate(name, profile)
        results[name] = {"real": real[name], "sim": sim, "comparison": compare(real[name], sim)}
    report = {"benchmark": "sim_validate", "profile": str(profile), "tolerance": 0.2,
              "all_within": all(r["within"] for e in results.values() for r in e["comparison"]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(["python"] + sys.argv),
              **extra, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    print("all within 20%:", report["all_within"])


if __name__ == "__main__":
    main()
