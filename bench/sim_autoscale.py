"""The autoscaler in the simulator: a load step and a diurnal curve, against static splits.

This machine's workers (the fitted CPU profile), chat-like requests (128-512 prompt tokens,
32-128 output tokens), Poisson arrivals whose rate follows (a) a step: 1 req/s, 5 req/s for 5 minutes, 1 req/s
again; (b) a day compressed into 30 minutes: a sine between 0.2x and 1x of the peak. The
autoscaler (cluster/autoscaler.py, default hysteresis and cool-down; new workers serve 8 s after
they are asked for, as a CPU worker's start-up takes here) starts from 1 prefill + 1 decode worker
and may use 1-3 prefill and 1-4 decode workers. Compared with the smallest static split (1+1)
and the peak-sized one (3+4): SLO attainment, worker-seconds used, scaling actions, and how often
a pool reversed direction (an oscillation is a reversal within 2 cool-downs).

    .venv/bin/python -m bench.sim_autoscale [--profile bench/results/cost_profile_cpu.json]

Writes bench/results/sim_autoscale.json and bench/results/sim_autoscale_{step,diurnal}.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from cluster.autoscaler_config import AutoscalerConfig
from cluster.sim import SLO, ClusterSpec, LengthDist, Simulator, WorkloadSpec, load_cost_model
from cluster.sim.autoscaling import attach_to_simulator
from cluster.sim.metrics import pyplot

SLO_TARGET = SLO(ttft_s=3.0, tpot_s=0.25)
CONFIG = AutoscalerConfig(
    enabled=True,
    interval_s=5.0,
    window_s=20.0,
    slo_ttft_s=3.0,
    slo_tpot_s=0.25,
    min_prefill_workers=1,
    max_prefill_workers=3,
    min_decode_workers=1,
    max_decode_workers=4,
    down_after=6,
    cooldown_s=30.0,
)
STARTUP_S = 8.0


def workloads(peak: float) -> dict[str, WorkloadSpec]:
    base = WorkloadSpec(
        rate=peak,
        prompt_len=LengthDist("uniform", low=128, high=512),
        output_len=LengthDist("uniform", low=32, high=128),
        seed=3,
    )
    day = tuple((t, 0.6 - 0.4 * math.cos(2 * math.pi * t / 1800)) for t in range(0, 1801, 60))
    return {
        "step": replace(
            base,
            name="step",
            duration_s=900,
            rate_points=((0, 0.2), (240, 0.2), (240.01, 1.0), (540, 1.0), (540.01, 0.2)),
        ),
        "diurnal": replace(base, name="diurnal", duration_s=1800, rate_points=day),
    }


def reversals(actions: list[dict], cooldown_s: float) -> int:
    """Direction changes of a pool within two cool-downs of its previous change."""
    count = 0
    for pool in ("prefill", "decode"):
        acts = [a for a in actions if a["pool"] == pool]
        for a, b in zip(acts, acts[1:]):
            if (a["to"] - a["from"]) * (b["to"] - b["from"]) < 0 and b["t"] - a["t"] < 2 * cooldown_s:
                count += 1
    return count


def run(spec: WorkloadSpec, cost, overheads, link, split: tuple[int, int], autoscale: bool) -> dict:
    sim = Simulator(ClusterSpec(*split), cost, overheads, link, record_itl=False)
    if autoscale:
        actions = attach_to_simulator(sim, CONFIG, startup_s=STARTUP_S).actions
    else:
        actions = []
    result = sim.run(spec.generate())
    summary = result.summary(SLO_TARGET)
    worker_s = sum(p.gpu_seconds for p in result.pools.values())
    return {
        "split": "autoscaled from 1P:1D" if autoscale else f"static {split[0]}P:{split[1]}D",
        "slo_attainment": summary["slo_attainment"],
        "goodput": summary["goodput"],
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "tpot_p90_ms": summary["tpot_ms"]["p90"],
        "requests": summary["requests"],
        "failed": summary["failed"],
        "worker_seconds": worker_s,
        "scaling_actions": len(actions),
        "oscillations": reversals(actions, CONFIG.cooldown_s),
        "actions": actions,
        "timeline": result.timeline,
        "simulation_wall_s": result.sim_wall_s,
    }


def plot(name: str, spec: WorkloadSpec, runs: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in runs:
        t = [p["t"] for p in r["timeline"]]
        ax.step(
            t,
            [p["prefill_workers"] + p["decode_workers"] for p in r["timeline"]],
            where="post",
            label=f"{r['split']}: {r['slo_attainment']:.0%} SLO met, {r['worker_seconds']:.0f} worker-s",
        )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("workers serving")
    ax2 = ax.twinx()
    ts = [i * spec.duration_s / 300 for i in range(301)]
    ax2.plot(ts, [spec.rate_at(t) for t in ts], color="grey", alpha=0.4)
    ax2.set_ylabel("offered load (requests/s)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"autoscaler, {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="bench/results/cost_profile_cpu.json")
    ap.add_argument("--peak", type=float, default=None, help="peak requests/s (default: what 2P:3D sustain)")
    ap.add_argument("--out", default="bench/results/sim_autoscale.json")
    args = ap.parse_args()
    cost, overheads, link = load_cost_model(args.profile)
    started = time.perf_counter()
    peak = args.peak or 5.0
    report = {
        "benchmark": "sim_autoscale",
        "profile": args.profile,
        "slo": {"ttft_s": SLO_TARGET.ttft_s, "tpot_s": SLO_TARGET.tpot_s},
        "autoscaler": CONFIG.__dict__,
        "startup_s": STARTUP_S,
        "peak_rate": peak,
        "command": " ".join(["python"] + sys.argv),
        "scenarios": {},
    }
    for name, spec in workloads(peak).items():
        runs = [
            run(spec, cost, overheads, link, (1, 1), True),
            run(spec, cost, overheads, link, (1, 1), False),
            run(spec, cost, overheads, link, (3, 4), False),
        ]
        plot(name, spec, runs, Path(args.out).with_name(f"sim_autoscale_{name}.png"))
        report["scenarios"][name] = {"workload": spec.to_dict(), "runs": runs}
        for r in runs:
            print(
                f"{name:8} {r['split']:24} SLO met {r['slo_attainment']:6.1%}  worker-s {r['worker_seconds']:7.0f}  "
                f"actions {r['scaling_actions']:2}  oscillations {r['oscillations']}",
                flush=True,
            )
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
