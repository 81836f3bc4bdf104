"""FP8 weights and FP8 KV cache on the default model (SmolLM2-135M-Instruct) against float32.

    .venv/bin/python -m bench.fp8_accuracy [--windows 20] [--out bench/results/fp8_accuracy.json]

Accuracy. Text: Python's offline `pydoc_data.topics`, the values of its sorted keys joined with
"\\n\\n", tokenized whole, cut into `--windows` consecutive windows of 1024 tokens without
overlap from the start (20 windows = 20,480 tokens, 20,460 predictions). Each window is scored
from an empty context with `LLMEngine.score` (chunked prefill through the paged KV cache, chunks
of 256 tokens, so later chunks read K/V back from the cache: FP8 KV is exercised). Perplexity =
exp(-mean log p) over all predictions. Greedy agreement: 20 fixed chat prompts, 32 new tokens
each (ignore_eos), compared with float32 token by token.

KV cache scales are calibrated on the text shipped in workers/engine/kv_calibration.py, not on this one.

Memory. Weight bytes are summed over the model's tensors for float32, bfloat16 and FP8 weights;
KV capacity is the cache's token count at a fixed 64 MiB budget for float32, bfloat16 and FP8.
Transfer. Two EngineWorkers in this process with the shared-memory transport: one 256-token
prompt prefilled on one and pushed to the other; kv_bytes_sent / prompt_tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

import torch

from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.evaluation import CHUNK, WINDOW, chat_prompts, eval_windows
from workers.engine.llm_engine import LLMEngine
from workers.quantization.fp8 import weight_memory

NEW_TOKENS = 32
KV_BUDGET = 64 << 20
CONFIGS = {
    "float32": dict(float32_prompt_matmul="ieee"),
    "fp8 weights": dict(quantization="fp8"),
    "fp8 KV": dict(kv_cache_dtype="fp8"),
    "fp8 weights + KV": dict(quantization="fp8", kv_cache_dtype="fp8"),
    # Not FP8, but the same question for `--dtype bfloat16` (weights, activations and KV in
    # bfloat16; norms, softmax and attention sums in float32), the fast mode on CPUs with bf16 FMA.
    "bfloat16": dict(dtype="bfloat16"),
    # float32 with the prompt tokens' projections as bf16x3 on AMX (the default where the CPU has
    # AMX-BF16; kernels/amx_linear.py): scoring is all prompt tokens, greedy decoding mostly not.
    "float32, bf16x3 prompts": dict(float32_prompt_matmul="bf16x3"),
}
LIMITS = {
    "fp8 weights": 0.03,
    "fp8 KV": 0.03,
    "fp8 weights + KV": 0.05,
    "bfloat16": 0.01,
    "float32, bf16x3 prompts": 0.001,
}


def perplexity(engine: LLMEngine, windows: list[list[int]]) -> tuple[float, int]:
    logprobs = torch.cat([engine.score(w, chunk_size=CHUNK) for w in windows])
    return math.exp(-float(logprobs.double().mean())), logprobs.numel()


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params)]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(ours, ref)]
    same = sum(a == b for o, r in zip(ours, ref) for a, b in zip(o, r))
    return {
        "identical_prompts": sum(p == NEW_TOKENS for p in prefixes),
        "num_prompts": len(ref),
        "mean_identical_prefix": sum(prefixes) / len(prefixes),
        "position_match_rate": same / (len(ref) * NEW_TOKENS),
    }


def transfer_bytes(dtype: str, kv_cache_dtype: str) -> dict:
    from testkit import workers as calls
    from workers.shell.worker import EngineWorker, WorkerConfig

    ec = EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64)
    P = EngineWorker(WorkerConfig("p0", "prefill", None, ec, transport="shm"))
    D = EngineWorker(WorkerConfig("d0", "decode", None, ec, transport="shm"))
    try:
        prompt = list(range(1000, 1256))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        r = calls.reserve(D, "t1", prompt, params)
        res = calls.prefill(P, "t1", prompt, params, D.endpoint(), r)
        calls.start_decode(D, "t1", res.output.token_ids[0])
        deadline = time.monotonic() + 60
        while not any(o.finished for o in D.poll_outputs(1.0)):
            assert time.monotonic() < deadline, "decode did not finish"
        stats = P.stats()
        return {
            "kv_bytes_sent": stats.kv_bytes_sent,
            "prompt_tokens": stats.prompt_tokens,
            "bytes_per_prompt_token": stats.kv_bytes_sent / stats.prompt_tokens,
        }
    finally:
        P.shutdown()
        D.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=20)
    # One thread by default: on a shared CPU, torch's OpenMP threads spin at barriers when another
    # process holds a core, and small decode matmuls became 50x slower (measured here).
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", default=str(REPO / "bench/results/fp8_accuracy.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from workers.models.files import resolve_model_dir

    started = time.perf_counter()
    model_dir = resolve_model_dir(None, quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = eval_windows(tokenizer, args.windows)
    prompts = chat_prompts(tokenizer)

    rows = {}
    reference = None
    for name, overrides in CONFIGS.items():
        t0 = time.perf_counter()
        engine = load_engine(None, EngineConfig(kv_cache_memory=256 << 20, **overrides))
        t1 = time.perf_counter()
        ppl, n = perplexity(engine, windows)
        t2 = time.perf_counter()
        tokens = greedy(engine, prompts)
        t3 = time.perf_counter()
        reference = reference or {"ppl": ppl, "tokens": tokens}
        mem = weight_memory(engine.runner.model)
        rows[name] = {
            "config": overrides,
            "perplexity": ppl,
            "predictions": n,
            "ppl_change": ppl / reference["ppl"] - 1.0,
            "ppl_limit": LIMITS.get(name),
            "within_limit": ppl / reference["ppl"] - 1.0 <= LIMITS.get(name, 0.0),
            "greedy": agreement(tokens, reference["tokens"]),
            "linear_weight_bytes": mem.linear_bytes,
            "total_weight_bytes": mem.total_bytes,
            "kv_scales_layer0": engine.runner.kv_scales[0],
            "seconds": time.perf_counter() - t0,
            "load_seconds": t1 - t0,
            "score_seconds": t2 - t1,
            "greedy_seconds": t3 - t2,
        }
        print(
            f"{name}: ppl {ppl:.4f} ({rows[name]['ppl_change']:+.2%}); load {t1 - t0:.0f} s, "
            f"score {t2 - t1:.0f} s, greedy {t3 - t2:.0f} s",
            flush=True,
        )
        del engine

    bf16 = load_engine(None, EngineConfig(dtype="bfloat16", num_kv_blocks=1))
    mem_bf16 = weight_memory(bf16.runner.model)
    del bf16
    # FP8 linear layers with the rest (embeddings, norms) in bfloat16, as a GPU deployment would run.
    fp8_bf16 = load_engine(None, EngineConfig(dtype="bfloat16", quantization="fp8", num_kv_blocks=1))
    mem_fp8_bf16 = weight_memory(fp8_bf16.runner.model)
    del fp8_bf16
    memory = {
        "weights": {
            "float32": {
                "linear": rows["float32"]["linear_weight_bytes"],
                "total": rows["float32"]["total_weight_bytes"],
            },
            "bfloat16": {"linear": mem_bf16.linear_bytes, "total": mem_bf16.total_bytes},
            "fp8": {
                "linear": rows["fp8 weights"]["linear_weight_bytes"],
                "total": rows["fp8 weights"]["total_weight_bytes"],
            },
            "fp8 (rest bfloat16)": {"linear": mem_fp8_bf16.linear_bytes, "total": mem_fp8_bf16.total_bytes},
        }
    }
    kv = {}
    for dtype, kv_dtype in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8")):
        e = load_engine(None, EngineConfig(dtype=dtype, kv_cache_dtype=kv_dtype, kv_cache_memory=KV_BUDGET))
        cache = e.runner.kv_cache
        kv["fp8" if kv_dtype == "fp8" else dtype] = {
            "cache_bytes": cache.numel() * cache.element_size(),
            "capacity_tokens": e.runner.num_blocks * e.config.block_size,
        }
        del e
    memory["kv_capacity_at_64MiB"] = kv
    transfer = {
        name: transfer_bytes(dt, kvd)
        for name, dt, kvd in (
            ("float32", "float32", "auto"),
            ("bfloat16", "bfloat16", "auto"),
            ("fp8", "float32", "fp8"),
        )
    }

    result = {
        "model": "SmolLM2-135M-Instruct",
        "text": "pydoc_data.topics, sorted keys joined by blank lines",
        "windows": args.windows,
        "window_tokens": WINDOW,
        "score_chunk": CHUNK,
        "greedy_new_tokens": NEW_TOKENS,
        "rows": rows,
        "memory": memory,
        "transfer": transfer,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"\nSmolLM2-135M-Instruct, {args.windows} x {WINDOW} tokens of pydoc topics, "
        f"greedy: 20 prompts x {NEW_TOKENS} tokens\n"
    )
    print(
        "| config | perplexity | vs float32 | limit | identical greedy (of 20) "
        "| mean identical prefix | position match |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        g = r["greedy"]
        limit = f"{r['ppl_limit']:.0%}" if r["ppl_limit"] else ""
        print(
            f"| {name} | {r['perplexity']:.4f} | {r['ppl_change']:+.2%} | {limit} | {g['identical_prompts']} | "
            f"{g['mean_identical_prefix']:.1f} / {NEW_TOKENS} | {g['position_match_rate']:.1%} |"
        )
    w = memory["weights"]
    print("\n| weights | linear layers (MB) | whole model (MB) |\n|---|---|---|")
    for k, v in w.items():
        print(f"| {k} | {v['linear'] / 1e6:.1f} | {v['total'] / 1e6:.1f} |")
    print("\n| KV dtype | tokens in 64 MiB | KV bytes sent per prompt token |\n|---|---|---|")
    for k in ("float32", "bfloat16", "fp8"):
        print(f"| {k} | {kv[k]['capacity_tokens']} | {transfer[k]['bytes_per_prompt_token']:.0f} |")
    print(
        f"\nlinear weights fp8 / bfloat16 = {w['fp8']['linear'] / w['bfloat16']['linear']:.3f}; "
        f"KV tokens fp8 / bfloat16 = {kv['fp8']['capacity_tokens'] / kv['bfloat16']['capacity_tokens']:.2f}, "
        f"fp8 / float32 = {kv['fp8']['capacity_tokens'] / kv['float32']['capacity_tokens']:.2f}"
    )
    print(f"\n{result['seconds']:.0f} s; JSON in {out}")


if __name__ == "__main__":
    main()
