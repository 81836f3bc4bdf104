"""`baton plan`: size the prefill and decode pools for SLOs with the planner and the simulator.

    baton plan --gpus 8 --model-profile bench/results/cost_profile_cpu.json \\
        --slo-ttft 3s --slo-tpot 250ms --workload docs/examples/chat_workload.yaml --plot plan.png
    baton plan --gpus 16 --model-profile roofline:H100:llama-8b:fp8 --slo-ttft 500ms --slo-tpot 30ms --workload W

--model-profile is a profile written by bench/profile_costs.py (this machine's workers), a JSON
roofline spec ({"cost_model": {"kind": "roofline", "gpu": "H200", ...}}), or the short form
roofline:GPU:MODEL[:fp8|bf16[:TP]]. --workload is a YAML/JSON WorkloadSpec (cluster/sim/workload.py):
its length distributions, prefix groups and arrival shape; the planner varies its rate.

LoRA: --lora-adapters N (with --lora-dist, --lora-zipf-s, --lora-base-fraction) puts the
workload's requests under N adapters (or its own `adapters:` mapping does), and --max-loras /
--max-cpu-loras size each worker's adapter slots (default with a mix: 1, the worker's default);
--lora-slot-load, --lora-disk-load and --lora-step-fraction replace the LoRA cost model's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from cluster.planner import Plan, PlanProblem, SplitEvaluations, exhaustive, plan, plot_plan
from cluster.sim.costs import GPUS, LINKS, MODELS, RooflineCostModel, ServingOverheads, load_cost_model
from cluster.sim.engine import EngineSettings
from cluster.sim.metrics import SLO
from cluster.sim.simulator import ClusterSpec, Simulator
from cluster.sim.workload import AdapterMix, WorkloadSpec

__all__ = ["add_plan_parser", "parse_duration", "run_plan"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*$")


def parse_duration(text: str) -> float:
    """'2s', '50ms', '0.5' (seconds) -> seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a duration; use e.g. 2s, 500ms or 0.5")
    value = float(match.group(1))
    return value / 1000 if match.group(2) == "ms" else value


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="size the prefill and decode pools for TTFT/TPOT SLOs (simulated)",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs (or CPU worker slots) to spend")
    p.add_argument("--model-profile", required=True, help="profile JSON, or roofline:GPU:MODEL[:fp8|bf16[:TP]]")
    p.add_argument("--slo-ttft", type=parse_duration, required=True, help="TTFT SLO, e.g. 2s")
    p.add_argument("--slo-tpot", type=parse_duration, required=True, help="TPOT SLO, e.g. 50ms")
    p.add_argument("--workload", required=True, help="YAML/JSON workload spec")
    p.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet both SLOs")
    p.add_argument("--link", choices=sorted(LINKS), default=None, help="KV link (default: the profile's)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests-per-probe", type=int, default=400, help="simulated requests per rate probe")
    p.add_argument("--exhaustive", action="store_true", help="also simulate every split and compare")
    p.add_argument("--plot", default=None, help="PNG of goodput per GPU against the split")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    lora = p.add_argument_group("LoRA adapters (simulated: cluster/sim/lora.py)")
    lora.add_argument("--lora-adapters", type=int, default=None, help="requests spread over this many adapters")
    lora.add_argument("--lora-dist", choices=("zipf", "uniform"), default="zipf", help="adapter popularity")
    lora.add_argument("--lora-zipf-s", type=float, default=1.0, help="Zipf exponent: adapter k has weight 1/(k+1)^s")
    lora.add_argument("--lora-base-fraction", type=float, default=0.0, help="share of requests on the base model")
    lora.add_argument("--max-loras", type=int, default=None, help="adapters in one step's batch (device slots)")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory")
    lora.add_argument("--lora-slot-load", type=parse_duration, default=None, help="host -> device slot, per adapter")
    lora.add_argument("--lora-disk-load", type=parse_duration, default=None, help="disk -> host memory, per adapter")
    lora.add_argument(
        "--lora-step-fraction", type=float, default=None, help="step time added per distinct adapter in a batch"
    )


def _cost(spec: str):
    if spec.startswith("roofline:"):
        parts = spec.split(":")[1:]
        if len(parts) < 2 or parts[0] not in GPUS or parts[1] not in MODELS:
            raise ValueError(
                f"--model-profile {spec!r}: use roofline:GPU:MODEL[:fp8|bf16[:TP]] with GPU one of "
                f"{sorted(GPUS)} and MODEL one of {sorted(MODELS)}"
            )
        dtype = parts[2] if len(parts) > 2 else "fp8"
        tp = int(parts[3]) if len(parts) > 3 else 1
        return (
            RooflineCostModel(GPUS[parts[0]], MODELS[parts[1]], dtype, dtype, tp),
            ServingOverheads(),
            LINKS["nvlink"],
        )
    return load_cost_model(spec)


def run_plan(args: argparse.Namespace) -> int:
    try:
        cost, overheads, link = _cost(args.model_profile)
        workload = WorkloadSpec.load(args.workload)
        if args.lora_adapters is not None:
            mix = AdapterMix(args.lora_adapters, args.lora_dist, args.lora_zipf_s, args.lora_base_fraction)
            workload = dataclasses.replace(workload, adapters=mix)
        gpu_scale = isinstance(cost, RooflineCostModel)  # GPU engines batch more than this CPU's defaults
        lora_costs = {
            name: value
            for name, value in (
                ("lora_slot_load_s", args.lora_slot_load),
                ("lora_disk_load_s", args.lora_disk_load),
                ("lora_step_fraction", args.lora_step_fraction),
            )
            if value is not None
        }
        engine = EngineSettings(
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs or (256 if gpu_scale else 64),
            max_num_batched_tokens=args.max_num_batched_tokens or (8192 if gpu_scale else 256),
            max_loras=args.max_loras if args.max_loras is not None else (1 if workload.adapters else 0),
            max_cpu_loras=args.max_cpu_loras,
            **lora_costs,
        )
        problem = PlanProblem(
            args.gpus,
            workload,
            SLO(args.slo_ttft, args.slo_tpot),
            cost,
            None,
            overheads,
            LINKS[args.link] if args.link else link,
            engine,
            attainment=args.attainment,
            requests_per_probe=args.requests_per_probe,
        )
    except ValueError as exc:
        print(f"baton plan: {exc}", file=sys.stderr)
        return 2
    evaluations = SplitEvaluations(problem)  # what the plan simulated, exhaustive search does not again
    chosen = plan(problem, evaluations)
    plans: list[Plan] = [chosen]
    if args.exhaustive:
        plans.insert(0, exhaustive(problem, evaluations))
    best = chosen.best
    # The chosen split at the workload's own rate.
    sim = Simulator(
        ClusterSpec(best.prefill_workers, best.decode_workers, engine), cost, overheads, problem.link, record_itl=False
    )
    at_rate = sim.run(workload.generate()).summary(problem.slo)
    g = cost.gpus_per_worker()
    print(
        f"plan for {args.gpus} GPUs ({g} per worker): {best.prefill_workers} prefill + {best.decode_workers} decode "
        f"workers" + (" (colocated: decode workers prefill)" if best.prefill_workers == 0 else "")
    )
    print(
        f"  goodput {best.goodput:.3g} requests/s ({best.goodput_per_gpu:.3g} per GPU) with >= "
        f"{args.attainment:.0%} of requests within TTFT {args.slo_ttft * 1e3:.0f} ms "
        f"and TPOT {args.slo_tpot * 1e3:.0f} ms"
    )
    print(
        f"  at the workload's rate ({workload.rate:g}/s): SLO attainment {at_rate['slo_attainment']:.1%}, "
        f"TTFT p99 {at_rate['ttft_ms']['p99'] or 0:.0f} ms, TPOT p99 {at_rate['tpot_ms']['p99'] or 0:.1f} ms"
    )
    lora = at_rate.get("lora")
    if lora is not None and workload.adapters is not None:
        mix = workload.adapters
        print(
            f"  LoRA: {mix.count} adapters ({mix.dist}"
            + (f", s={mix.zipf_s:g}" if mix.dist == "zipf" else "")
            + f", {mix.base_fraction:.0%} base model), max_loras {engine.max_loras}: at the workload's rate "
            f"{lora['slot_loads']} slot loads, {lora['disk_loads']} disk loads, steps waited {lora['load_s']:.2f} s"
        )
    print(
        f"  {chosen.simulations} simulations ({len(chosen.evaluated)} splits: "
        + ", ".join(f"{r.label} {r.goodput:.3g}/s" for r in chosen.evaluated)
        + ")"
    )
    if args.exhaustive:
        ex = plans[0]
        print(
            f"  exhaustive search: best {ex.best.label} at {ex.best.goodput:.3g}/s ({ex.simulations} simulations); "
            f"the plan reaches {best.goodput_per_gpu / ex.best.goodput_per_gpu:.1%} of it"
            if ex.best.goodput_per_gpu
            else "  exhaustive search: no split meets the SLOs"
        )
    if args.plot:
        plot_plan(
            plans, args.plot, f"{args.gpus} GPUs, TTFT {args.slo_ttft * 1e3:.0f} ms, TPOT {args.slo_tpot * 1e3:.0f} ms"
        )
        print(f"  plot: {args.plot}")
    if args.json:
        data = {
            "plan": chosen.to_dict(),
            "at_workload_rate": at_rate,
            "workload": workload.to_dict(),
            "engine": dataclasses.asdict(engine),
            "exhaustive": plans[0].to_dict() if args.exhaustive else None,
        }
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0
