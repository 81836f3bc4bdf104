"""The planner's choice against exhaustive search, on held-out workloads.

Six workloads the planner was not tuned on (prompt-heavy, decode-heavy, balanced, shared-prefix
chat, bursty arrivals, long-tailed lengths), 8 worker slots of this machine's workers (the fitted
CPU profile), SLOs TTFT 4 s (8 s for the prompt-heavy one) and TPOT 250 ms at 90% attainment.
For each: `cluster.planner.plan` (estimate + hill climb) and `cluster.planner.exhaustive` (every
split, 0 to 7 prefill workers), goodput per GPU of each choice, and the simulations each needed.

    .venv/bin/python -m bench.sim_planner [--profile bench/results/cost_profile_cpu.json] [--gpus 8]

Writes bench/results/sim_planner.json and bench/results/sim_planner_<workload>.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cluster.planner import PlanProblem, exhaustive, plan, plot_plan
from cluster.sim import SLO, LengthDist, WorkloadSpec, load_cost_model


def U(lo, hi):
    return LengthDist("uniform", low=lo, high=hi)


HELD_OUT = {
    "prompt-heavy": (WorkloadSpec(rate=1, prompt_len=U(1024, 2048), output_len=U(16, 64), seed=11), 8.0),
    "decode-heavy": (WorkloadSpec(rate=1, prompt_len=U(32, 128), output_len=U(128, 256), seed=12), 4.0),
    "balanced": (WorkloadSpec(rate=1, prompt_len=U(256, 768), output_len=U(64, 192), seed=13), 4.0),
    "shared-prefix chat": (
        WorkloadSpec(
            rate=1,
            prompt_len=U(64, 256),
            output_len=U(32, 128),
            prefix_groups=4,
            prefix_len=512,
            prefix_fraction=0.8,
            seed=14,
        ),
        4.0,
    ),
    "bursty": (
        WorkloadSpec(rate=1, arrival="bursty", cv=3.0, prompt_len=U(256, 768), output_len=U(64, 192), seed=15),
        4.0,
    ),
    "long-tail": (
        WorkloadSpec(
            rate=1,
            prompt_len=LengthDist("lognormal", low=32, high=3000, mean=400, sigma=1.0),
            output_len=LengthDist("lognormal", low=8, high=512, mean=80, sigma=0.8),
            seed=16,
        ),
        4.0,
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="bench/results/cost_profile_cpu.json")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--requests-per-probe", type=int, default=150)
    ap.add_argument("--out", default="bench/results/sim_planner.json")
    args = ap.parse_args()
    cost, overheads, link = load_cost_model(args.profile)
    rows, started = [], time.perf_counter()
    for name, (wl, ttft) in HELD_OUT.items():
        problem = PlanProblem(
            args.gpus,
            wl,
            SLO(ttft, 0.25),
            cost,
            overheads=overheads,
            link=link,
            requests_per_probe=args.requests_per_probe,
        )
        t0 = time.perf_counter()
        chosen = plan(problem)
        t1 = time.perf_counter()
        best = exhaustive(problem)
        t2 = time.perf_counter()
        ratio = chosen.best.goodput_per_gpu / best.best.goodput_per_gpu if best.best.goodput_per_gpu else 1.0
        slug = name.replace(" ", "_")
        plot_plan([best, chosen], Path(args.out).with_name(f"sim_planner_{slug}.png"), f"{name}, {args.gpus} workers")
        row = {
            "workload": name,
            "slo": {"ttft_s": ttft, "tpot_s": 0.25},
            "planner": chosen.to_dict(),
            "exhaustive": best.to_dict(),
            "planner_fraction_of_best": ratio,
            "within_10pct": ratio >= 0.9,
            "planner_seconds": t1 - t0,
            "exhaustive_seconds": t2 - t1,
        }
        rows.append(row)
        print(
            f"{name:20} planner {chosen.best.label:7} {chosen.best.goodput:.3f}/s ({chosen.simulations:3} sims)  "
            f"exhaustive {best.best.label:7} {best.best.goodput:.3f}/s ({best.simulations:3} sims)  {ratio:.1%}",
            flush=True,
        )
    report = {
        "benchmark": "sim_planner",
        "profile": args.profile,
        "gpus": args.gpus,
        "attainment": 0.9,
        "all_within_10pct": all(r["within_10pct"] for r in rows),
        "wall_s": time.perf_counter() - started,
        "command": " ".join(["python"] + sys.argv),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
