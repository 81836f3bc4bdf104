"""A draft model under sampling: drafts drawn with the verification's keys against the draft's argmax.

The engine alone (no HTTP), one stream at a time, temperature 1 (seeded, so every engine gets the
same keys), prompts that ask the default model to repeat a passage of the CPython documentation
(bench.speculative_engine). Three engines side by side, alternating request by request: without
speculation; with the served model in bfloat16 drafting for itself, its drafts drawn from its own
distribution with the keys the verification uses (workers/speculative/draft_model.py); and the same draft
proposing its argmax (the proposer called without the keys). The draft budget decides how many
drafts each step verifies, as in serving.

    .venv/bin/python -m bench.speculative_draft_keys --out bench/results/speculative_draft_keys.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from bench.speculative_engine import repeat_prompts, timed
from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.models.files import resolve_model_dir


class ArgmaxDrafts:
    """A draft model's proposer asked without the verification's keys: it proposes its argmax."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.relative_cost = proposer.relative_cost

    def propose_many(self, seqs, limits, generators=None):
        return self.proposer.propose_many(seqs, limits)

    def forget(self, seq, finished: bool) -> None:
        self.proposer.forget(seq, finished)

    def drafting_seconds(self, measured: float):
        return self.proposer.drafting_seconds(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model_dir = resolve_model_dir(quiet=True)
    prompts = repeat_prompts(model_dir)
    spec = json.dumps(
        {
            "method": "draft_model",
            "model": str(model_dir),
            "dtype": "bfloat16",
            "num_speculative_tokens": args.num_speculative_tokens,
        }
    )
    engines = {
        name: load_engine(
            model_dir, EngineConfig(kv_cache_memory=256 << 20, speculative_config=config, enable_prefix_caching=False)
        )
        for name, config in (("plain", None), ("draft_with_keys", spec), ("draft_argmax", spec))
    }
    engines["draft_argmax"].speculator.proposer = ArgmaxDrafts(engines["draft_argmax"].speculator.proposer)
    for engine in engines.values():  # warm-up: kernels, allocator
        engine.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0.0))
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1000 * round_ + i)
            for name, engine in engines.items():
                tokens, seconds, first, cpu, steps = timed(engine, prompt, params)
                runs[name].append(
                    {
                        "prompt": i,
                        "seed": params.seed,
                        "tokens": len(tokens),
                        "seconds": seconds,
                        "steps": steps,
                        "tokens_per_s": len(tokens) / seconds,
                        "tokens_per_cpu_s": len(tokens) / cpu,
                    }
                )
    result = {
        "benchmark": "engine alone, one stream, temperature 1 (seeded), 'repeat this passage' prompts: a bfloat16 "
        "self-draft drawing with the verification's keys against the same draft proposing its argmax",
        "command": ".venv/bin/python -m bench.speculative_draft_keys",
        "model": model_dir.name,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "speculative_config": json.loads(spec),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "loadavg_at_end": list(os.getloadavg()),
        "engines": {},
        "runs": runs,
    }
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    for name, engine in engines.items():
        s = engine.stats().spec_decode
        tps = statistics.median(r["tokens_per_s"] for r in runs[name])
        result["engines"][name] = {
            "median_tokens_per_s": tps,
            "ratio_to_plain": tps / plain,
            "median_tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in runs[name]),
            "tokens_per_step": sum(r["tokens"] for r in runs[name]) / sum(r["steps"] for r in runs[name]),
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.num_accepted_tokens / max(s.num_draft_tokens, 1),
        }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
