"""What each request shape costs per token, against greedy, in one run.

    .venv/bin/python -m bench.sampling_cost [--batch 16] [--context 256] [--steps 12] [--reps 3]
        [--dtypes float32 bfloat16] [--out bench/results/sampling_cost.json]

Engine decode steps (the default model, one torch thread, as one worker of `baton serve`): --batch
sequences of --context random prompt tokens, all with one shape, decoding; a step's CPU time (this
process's, so that other processes' load does not swamp a few percent) per shape, the median of
--reps measurements of --steps steps, the shapes interleaved. Shapes: greedy; temperature 1 (the OpenAI default, what
`vllm bench serve` sends); top-p 0.9; top-k 50; min-p 0.05; penalties (presence 0.5, frequency
0.5, repetition 1.1); two stop strings; logprobs with the top 5; everything at once. `n` > 1 is not
supported by Baton (the router answers 400), so it is not measured.

"before" rows run the same steps with the sampler this work replaced (a Python loop over sampled
rows: full-vocabulary softmax and torch.multinomial per row, penalties and logprobs per row), kept
below as `legacy_sample`. The sampler alone on [batch, vocab] logits is timed too, both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch

from common.protocol import TokenLogprob
from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampler import SamplingRow, sample

SHAPES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
    "top-k 50": dict(temperature=1.0, top_k=50),
    "min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "penalties": dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "stop strings": dict(temperature=1.0, stop=["\n\nUser:", "<|im_end|> never"]),
    "logprobs (top 5)": dict(temperature=1.0, logprobs=5),
    "all of them": dict(
        temperature=0.8,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        stop=["\n\nUser:"],
        logprobs=5,
    ),
}


# ---- the sampler before this work (workers/engine/sampler.py at commit e27f49d), for the "before" rows ----
def _legacy_penalties(logits, row):
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.tensor(row.output_token_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def _legacy_filter(logits, p):
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def legacy_sample(logits, rows):
    raw = logits
    needs_copy = any(r.params.needs_penalties or r.banned_token_ids for r in rows)
    work = logits.clone() if needs_copy else logits
    for i, row in enumerate(rows):
        if row.params.needs_penalties:
            work[i] = _legacy_penalties(work[i], row)
        if row.banned_token_ids:
            work[i, list(row.banned_token_ids)] = float("-inf")
    tokens = work.argmax(-1).tolist()
    for i, row in enumerate(rows):
        if row.params.greedy:
            continue
        probs = _legacy_filter(work[i], row.params).softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())
    logprobs = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            top = []
            if n:
                values, ids = torch.topk(lp[j], n)
                top = list(zip(ids.tolist(), values.tolist()))
            logprobs[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), top)
    return tokens, logprobs


# ---- measurements ------------------------------------------------------------------------------
def step_ms(engine: LLMEngine, params: SamplingParams, prompts: list[list[int]], steps: int) -> float:
    """Decode steps of len(prompts) sequences of this shape: CPU ms per step (prefill not counted).
    CPU time of this process, not wall time: other processes on the machine would swamp a few percent."""
    ids = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    start = time.process_time()
    for _ in range(steps):
        engine.step()
    elapsed = time.process_time() - start
    for rid in ids:
        engine.abort(rid)
    return elapsed / steps * 1000


def sampler_ms(fn, vocab: int, batch: int, context: int, params: SamplingParams, reps: int = 20) -> float:
    g, rng = torch.Generator().manual_seed(0), random.Random(0)
    logits = torch.randn(batch, vocab, generator=g) * 3
    rows = [
        SamplingRow(
            params, [rng.randrange(vocab) for _ in range(64)], [rng.randrange(vocab) for _ in range(context)], None
        )
        for _ in range(batch)
    ]
    fn(logits, rows)
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn(logits, rows)
        times.append(time.process_time() - start)
    return statistics.median(times) * 1000


def measure(dtype: str, args) -> dict:
    engine = load_engine(None, EngineConfig(dtype=dtype, max_num_seqs=args.batch, kv_cache_memory=512 << 20))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.context)] for _ in range(args.batch)]
    new_sampler = engine.sampler
    samplers = {"after": new_sampler, "before": legacy_sample}
    runs: dict[str, dict[str, list[float]]] = {k: {name: [] for name in SHAPES} for k in samplers}
    for _ in range(args.reps):
        for name, shape in SHAPES.items():
            for which, sampler in samplers.items():
                engine.sampler = sampler
                params = SamplingParams(max_tokens=100_000, ignore_eos=True, **shape)
                runs[which][name].append(step_ms(engine, params, prompts, args.steps))
    engine.sampler = new_sampler
    vocab = engine.model_config.vocab_size
    out = {"dtype": dtype, "steps": {}}
    for which in samplers:
        greedy = statistics.median(runs[which]["greedy"])
        out["steps"][which] = {
            name: {
                "step_ms": statistics.median(v),
                "all_ms": v,
                "tokens_per_s": args.batch / statistics.median(v) * 1000,
                "cost_vs_greedy": statistics.median(v) / greedy - 1.0,
            }
            for name, v in runs[which].items()
        }
    out["sampler_alone_ms"] = {
        which: {
            name: sampler_ms(fn, vocab, args.batch, args.context, SamplingParams(**shape))
            for name, shape in SHAPES.items()
            if "stop" not in shape
        }
        for which, fn in (
            ("after", lambda logits, rows: sample(logits, rows, None, new_sampler.race)),
            ("before", legacy_sample),
        )
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sampling_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    results = [measure(dtype, args) for dtype in args.dtypes]
    for r in results:
        print(f"\n{r['dtype']}: decode step of {args.batch} sequences (ms), cost vs greedy")
        print("| shape | before | after | sampler alone before / after (ms) |")
        print("|---|---:|---:|---:|")
        for name in SHAPES:
            b, a = r["steps"]["before"][name], r["steps"]["after"][name]
            alone_b = r["sampler_alone_ms"]["before"].get(name)
            alone_a = r["sampler_alone_ms"]["after"].get(name)
            alone = f"{alone_b:.2f} / {alone_a:.2f}" if alone_b is not None else "-"
            print(
                f"| {name} | {b['step_ms']:.1f} ({b['cost_vs_greedy']:+.1%}) | {a['step_ms']:.1f} "
                f"({a['cost_vs_greedy']:+.1%}) | {alone} |"
            )
    doc = {
        "benchmark": "sampling cost per request shape",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([sys.executable, *sys.argv]),
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "reps": args.reps,
        "torch_threads": 1,
        "clock": "process CPU time",
        "n_supported": False,
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "runs": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
