"""The grammar mask's cost per decode step: Baton's native CPU kernel against xgrammar's CPU kernel.

    .venv/bin/python -m bench.token_bitmask [--rows 16] [--reps 200] [--out bench/results/token_bitmask.json]

The masks are real: the five JSON schemas of bench/structured.py compiled for the default model,
each matcher walked along the tokens of a valid reply written by hand, one bitmask row taken at
each position (strings, where most tokens are allowed, as well as punctuation, where few are); a
batch of --rows such rows (different
schemas and positions) is applied to float32 logits [rows, vocab] by each kernel in turn, the
kernels interleaved, one torch thread, this process's CPU time, the median of --reps. The outputs
are checked equal before timing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import xgrammar

from bench.structured_load import SCHEMAS
from common.sampling_params import StructuredOutput
from kernels.token_bitmask import apply_token_bitmask_cpu
from router.tokenizer import Tokenizer
from workers.engine.grammar import GrammarCache
from workers.models.config import ModelConfig
from workers.models.files import resolve_model_dir

REPO = Path(__file__).resolve().parents[1]


def grammar_masks(model_dir: Path) -> tuple[torch.Tensor, int]:
    """Bitmask rows [n, words] met along valid replies of every schema, and the vocab size."""
    config = ModelConfig.from_model_dir(model_dir)
    cache = GrammarCache(model_dir, config.vocab_size, config.eos_token_ids)
    tok = Tokenizer.from_model_dir(model_dir)
    replies = {
        "person": {"name": "Ada Lovelace", "age": 36},
        "order": {"id": "ABC-1234", "status": "shipped", "total": 12.5},
        "tags": {"tags": ["red", "blue"]},
        "address": {"city": "Paris", "location": {"lat": 48.85, "lon": 2.35}},
        "flag": {"ok": True, "code": 404},
    }
    rows = []
    for name, schema in SCHEMAS.items():
        state = cache.state(StructuredOutput("json_schema", json.dumps(schema)))
        for token in tok.encode(json.dumps(replies[name]), add_special_tokens=False):
            mask = xgrammar.allocate_token_bitmask(1, config.vocab_size)
            state.fill_bitmask(mask, 0)
            rows.append(mask[0])
            if not state.accept(token):
                break
    return torch.stack(rows), config.vocab_size


def cpu_ms(fn, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> float:
    work = logits.clone()
    started = time.process_time()
    fn(work, bitmask, rows)
    return (time.process_time() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "token_bitmask.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    masks, vocab = grammar_masks(resolve_model_dir(None, quiet=True))
    pick = random.Random(0)
    bitmask = masks[[pick.randrange(len(masks)) for _ in range(args.rows)]].contiguous()
    logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0))
    rows = list(range(args.rows))
    kernels = {
        "xgrammar_cpu": lambda x, m, r: xgrammar.apply_token_bitmask_inplace(x, m, indices=r),
        "baton_native": apply_token_bitmask_cpu,
    }
    outs = {}
    for name, fn in kernels.items():
        outs[name] = logits.clone()
        fn(outs[name], bitmask, rows)
    assert torch.equal(outs["xgrammar_cpu"], outs["baton_native"]), "the kernels disagree"
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.reps):
        for name, fn in kernels.items():
            times[name].append(cpu_ms(fn, logits, bitmask, rows))
    medians = {name: round(statistics.median(t), 4) for name, t in times.items()}
    allowed = float(((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).float().mean())
    result = {
        "benchmark": "token_bitmask",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": args.rows,
        "vocab": vocab,
        "reps": args.reps,
        "masks_met": len(masks),
        "allowed_fraction": round(allowed, 4),
        "cpu_ms_median": medians,
        "speedup": round(medians["xgrammar_cpu"] / medians["baton_native"], 1),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
