"""What a draft token costs in a decode step, against what the draft budget believes.

The engine alone (no HTTP, no Ray), one thread as a decode worker has here: a plain engine and an
n-gram engine decode the same batch of repeat-a-passage prompts (bench.speculative_engine's) at
temperature 1, interleaved round by round. Every all-decode step's seconds are kept by its token
count (the batch plus the drafts it verifies). Reported: the median step by token count, the
ordinary least-squares fit t = a + b * tokens over the n-gram engine's steps (rho = b / a, the
cost of one more token relative to the step's fixed part), the rho the engine's own decayed fit
(workers.speculative.draft_budget.StepCostFit) ended at, the drafts verified and accepted, and both engines'
tokens per second.

    .venv/bin/python -m bench.speculative_step_cost --batch 4 --out bench/results/speculative_step_cost_b4.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from bench.speculative_engine import SPECULATIVE_CONFIG, repeat_prompts
from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.models.files import resolve_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model_dir = resolve_model_dir(quiet=True)
    prompts = repeat_prompts(model_dir)
    engines = {
        name: load_engine(
            model_dir,
            EngineConfig(
                kv_cache_memory=256 << 20, speculative_config=spec, enable_prefix_caching=False, num_threads=1
            ),
        )
        for name, spec in (("plain", None), ("ngram", SPECULATIVE_CONFIG))
    }
    steps: dict[str, dict[int, list[float]]] = {name: {} for name in engines}
    longest = 1 + json.loads(SPECULATIVE_CONFIG)["num_speculative_tokens"]
    for name, engine in engines.items():
        engine.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

        def keep(shape, seconds, name=name):
            if len(shape) == args.batch and all(sampled and n <= longest for _, n, sampled in shape):
                steps[name].setdefault(sum(n for _, n, _ in shape), []).append(seconds)

        engine.observe_steps(keep)
    tokens_per_s: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        batch = [prompts[(r * args.batch + i) % len(prompts)] for i in range(args.batch)]
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            params = [
                SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=7 + i, ignore_eos=True)
                for i in range(args.batch)
            ]
            started = time.perf_counter()
            outputs = engines[name].generate(batch, params)
            tokens_per_s[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started))
    xs = [n for n, seconds in steps["ngram"].items() for _ in seconds]
    ys = [s for seconds in steps["ngram"].values() for s in seconds]
    slope, intercept = np.polyfit(xs, ys, 1) if len(set(xs)) > 1 else (float("nan"), float("nan"))
    speculator = engines["ngram"].speculator
    counters = speculator.counters
    result = {
        "command": f".venv/bin/python -m bench.speculative_step_cost --batch {args.batch} "
        f"--max-tokens {args.max_tokens} "
        f"--rounds {args.rounds} --temperature {args.temperature}",
        "machine": f"{platform.machine()}, {platform.node()}",
        "speculative_config": json.loads(SPECULATIVE_CONFIG),
        "step_ms_by_tokens": {
            name: {
                str(n): {"steps": len(v), "median": round(statistics.median(v) * 1e3, 2)} for n, v in sorted(by.items())
            }
            for name, by in steps.items()
        },
        "ols_over_ngram_steps": {
            "slope_ms": round(slope * 1e3, 3),
            "intercept_ms": round(intercept * 1e3, 3),
            "rho": round(slope / intercept, 4),
        },
        "engine_fit_rho": round(speculator.step_cost.token_cost(args.batch), 4),
        "drafts": {
            "verified_steps": counters.num_drafts,
            "draft_tokens": counters.num_draft_tokens,
            "accepted_tokens": counters.num_accepted_tokens,
        },
        "tokens_per_s": {name: [round(v, 1) for v in values] for name, values in tokens_per_s.items()},
        "ngram_over_plain": round(sum(tokens_per_s["ngram"]) / sum(tokens_per_s["plain"]), 3),
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
