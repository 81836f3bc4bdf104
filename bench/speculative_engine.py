"""Single-stream tokens/s of the engine alone (no HTTP, no Ray) without speculation and with each
method (n-gram; suffix on the request's own tokens only; suffix with the outputs of earlier
requests cached), on prompts that ask the model to repeat a passage from the CPython docs
(`pydoc_data.topics`).

    .venv/bin/python -m bench.speculative_engine --out bench/results/speculative_engine_cpu.json

The engines are loaded side by side and run alternately (rounds), so a busy machine slows them
alike; the median of the rounds is reported, per wall second and per CPU second of this process
(steadier on a shared machine), with the model steps each reply took. The rounds repeat the same
prompts, so from the second round on the suffix engine with a cache finds each reply among the
outputs it cached: that row is the best case of a workload that repeats itself. The greedy tokens of
every engine must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.models.files import resolve_model_dir

SPECULATIVE_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
METHODS = {
    "plain": None,
    "ngram": SPECULATIVE_CONFIG,
    "suffix_own": '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 0}',
    "suffix": '{"method": "suffix", "num_speculative_tokens": 4}',
}
TOPICS = ("assert", "pass", "del")


def repeat_prompts(model_dir: Path) -> list[list[int]]:
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for key in TOPICS:
        passage = topics[key].strip()[:700]
        messages = [{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{passage}"}]
        prompts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
    return prompts


def timed(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float, float, float, int]:
    """(tokens, seconds to the last token, seconds to the first, CPU seconds, model steps)."""
    started, cpu = time.perf_counter(), time.process_time()
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    first = None
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.request_id == rid:
                tokens.extend(out.token_ids)
                if first is None and tokens:
                    first = time.perf_counter() - started
    return tokens, time.perf_counter() - started, first or 0.0, time.process_time() - cpu, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model_dir = resolve_model_dir(quiet=True)
    prompts = repeat_prompts(model_dir)
    engines = {
        name: load_engine(
            model_dir, EngineConfig(kv_cache_memory=256 << 20, speculative_config=spec, enable_prefix_caching=False)
        )
        for name, spec in METHODS.items()
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for engine in engines.values():  # warm-up: kernels, allocator
        engine.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0.0))
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    # Seconds of each one-sequence step past the prompt, by the tokens it ran (1: a plain decode,
    # 1 + k: a verification of k drafts): what checking drafts costs beside a plain step.
    step_seconds: dict[str, dict[int, list[float]]] = {name: {} for name in engines}
    for name, engine in engines.items():
        engine.observe_steps(
            lambda shape, seconds, name=name: (
                step_seconds[name].setdefault(shape[0][1], []).append(seconds)
                if len(shape) == 1 and shape[0][1] <= 8 and shape[0][0] > 0
                else None
            )
        )
    tokens_of: dict[str, list[list[int]]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name, engine in engines.items():
                tokens, seconds, first, cpu, steps = timed(engine, prompt, params)
                runs[name].append(
                    {
                        "prompt": i,
                        "tokens": len(tokens),
                        "seconds": seconds,
                        "ttft": first,
                        "cpu_seconds": cpu,
                        "steps": steps,
                        "tokens_per_s": len(tokens) / seconds,
                        "tokens_per_cpu_s": len(tokens) / cpu,
                        "decode_tokens_per_s": (len(tokens) - 1) / max(seconds - first, 1e-9),
                    }
                )
                tokens_of[name].append(tokens)
    spec_of = {name: engine.stats().spec_decode for name, engine in engines.items() if name != "plain"}
    spec = spec_of["ngram"]
    result = {
        "benchmark": "engine alone, one stream, greedy, 'repeat this passage' over pydoc_data.topics "
        + ",".join(TOPICS),
        "model": model_dir.name,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "speculative_config": json.loads(SPECULATIVE_CONFIG),
        "machine": f"{platform.machine()}, {platform.node()}",
        "speculative_configs": {name: json.loads(c) for name, c in METHODS.items() if c},
        "identical_tokens": all(tokens == tokens_of["plain"] for tokens in tokens_of.values()),
        "median_tokens_per_s": {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in runs.items()},
        "median_decode_tokens_per_s": {
            n: statistics.median(r["decode_tokens_per_s"] for r in rs) for n, rs in runs.items()
        },
        "median_tokens_per_cpu_s": {n: statistics.median(r["tokens_per_cpu_s"] for r in rs) for n, rs in runs.items()},
        "tokens_per_step": {n: sum(r["tokens"] for r in rs) / sum(r["steps"] for r in rs) for n, rs in runs.items()},
        "loadavg_at_end": list(os.getloadavg()),
        "acceptance_rate": spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
        "mean_accepted_per_verification": spec.num_accepted_tokens / max(spec.num_drafts, 1),
        "spec_decode": {
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "accepted_per_pos": list(spec.accepted_per_pos),
        },
        "methods": {
            name: {
                "acceptance_rate": s.num_accepted_tokens / max(s.num_draft_tokens, 1),
                "mean_accepted_per_verification": s.num_accepted_tokens / max(s.num_drafts, 1),
                "num_drafts": s.num_drafts,
                "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens,
            }
            for name, s in spec_of.items()
        },
        "step_ms": {
            name: {
                str(n): {"steps": len(v), "min": min(v) * 1e3, "median": statistics.median(v) * 1e3}
                for n, v in sorted(by_tokens.items())
            }
            for name, by_tokens in step_seconds.items()
        },
        "runs": runs,
    }
    plain, ngram = result["median_tokens_per_s"]["plain"], result["median_tokens_per_s"]["ngram"]
    result["speedup"] = ngram / plain
    result["speedup_cpu_time"] = result["median_tokens_per_cpu_s"]["ngram"] / result["median_tokens_per_cpu_s"]["plain"]
    for name in spec_of:
        result["methods"][name]["speedup"] = result["median_tokens_per_s"][name] / plain
        result["methods"][name]["speedup_cpu_time"] = (
            result["median_tokens_per_cpu_s"][name] / result["median_tokens_per_cpu_s"]["plain"]
        )
    text = json.dumps(result, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
