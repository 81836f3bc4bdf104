"""Engine throughput on one CUDA GPU: Baton's LLMEngine against transformers `generate`, side by side.

Run by tests/gpu/run.sh. The model is a random Llama with Llama-3.2-1B's layer shapes (hidden 2048,
16 layers, 32 query heads over 8 KV heads, head_dim 64, intermediate 8192; vocabulary 32,000 to keep
the file small), written as safetensors in bfloat16 (no hub download, nothing carried). Requests:
128-token random prompts, 128 greedy output tokens each, ignore_eos, so every system produces
exactly the same number of tokens.

Configurations:
- Baton bfloat16; bfloat16 with an FP8 KV cache (scales calibrated at start-up); FP8 weights
  (`quantization="fp8"`) with an FP8 KV cache. CUDA graphs for decode steps (the default).
- transformers bfloat16 `generate` (its default dynamic cache), the baseline.
At concurrency 1 (REQUESTS_AT_1 requests one after another) and CONCURRENCY (all at once: Baton's
continuous batching, transformers one batch of equal-length prompts, so no padding is wasted).
Also reported: for each request, how many of Baton bfloat16's greedy tokens equal transformers'
before the first difference (a random bfloat16 model has near ties, so this is a sanity figure,
not an exactness test; tests/gpu holds those), and for each batched configuration the wall time of
five full-batch decode steps with the top CUDA kernels under torch.profiler. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from tests.gpu.test_e2e_triton_vs_reference import write_random_llama

ARCH = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
)
PROMPT_LEN, OUTPUT_LEN = 128, 128
REQUESTS_AT_1, CONCURRENCY = 4, 64
KV_CACHE_MEMORY = 8 << 30


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, ARCH["vocab_size"]) for _ in range(PROMPT_LEN)] for _ in range(n)]


def timed(fn) -> tuple[object, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run_baton(folder: Path, device: str, concurrency: int, prompts: list[list[int]], **engine_kwargs) -> dict:
    from common.sampling_params import SamplingParams
    from workers.build import build_engine
    from workers.config import EngineConfig
    from workers.models.checkpoint import iter_safetensors
    from workers.models.config import ModelConfig

    config = EngineConfig(
        device=device,
        dtype="bfloat16",
        kv_cache_memory=KV_CACHE_MEMORY,
        max_num_seqs=concurrency,
        max_num_batched_tokens=max(2048, PROMPT_LEN),
        **engine_kwargs,
    )
    (engine, start_s) = timed(
        lambda: build_engine(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))
    )
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    # Warm-up on other prompts of the same shape: every Triton specialisation the timed run needs is
    # compiled first (prefix caching sees nothing of them).
    engine.generate(make_prompts(len(prompts), seed=99), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    # The timed lambdas take the engine as a default argument: `del engine` below unbinds the name.
    if concurrency == 1:
        outs, secs = timed(lambda eng=engine: [eng.generate([p], params)[0] for p in prompts])
    else:
        outs, secs = timed(lambda eng=engine: eng.generate(prompts, params))
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == len(prompts) * OUTPUT_LEN, tokens
    profile = profile_decode_steps(engine, prompts, params) if concurrency > 1 else None
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "output_tokens": tokens,
        "seconds": secs,
        "tok_s": tokens / secs,
        "engine_start_s": start_s,
        "token_ids": [o.token_ids for o in outs],
        "decode_step_profile": profile,
    }


def profile_decode_steps(engine, prompts: list[list[int]], params, steps: int = 5) -> dict:
    """Where a full batch's decode steps spend their time: the wall time of each, the top CUDA
    kernels under torch.profiler, and the engine's Python functions by own time under cProfile
    over as many more steps (printed; the step times are returned)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    for p in prompts:
        engine.add_request(p, params)
    for _ in range(3 + -(-len(prompts) * PROMPT_LEN // engine.config.max_num_batched_tokens)):
        engine.step()  # past the prefills: every sequence decoding
    step_ms = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _, secs = timed(engine.step)
            step_ms.append(secs * 1e3)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70), flush=True)
    python = cProfile.Profile()
    python.runcall(lambda: [engine.step() for _ in range(steps)])
    pstats.Stats(python).sort_stats("tottime").print_stats(15)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": step_ms}


def run_transformers(model, device: str, concurrency: int, prompts: list[list[int]]) -> dict:
    def generate(batch):
        ids = torch.tensor(batch, device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=OUTPUT_LEN,
            min_new_tokens=OUTPUT_LEN,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[:, PROMPT_LEN:].tolist()

    with torch.inference_mode():
        generate(make_prompts(1 if concurrency == 1 else len(prompts), seed=99))  # warm-up, as for Baton
        if concurrency == 1:
            outs, secs = timed(lambda: [generate([p])[0] for p in prompts])
        else:
            outs, secs = timed(lambda: generate(prompts))
    tokens = sum(len(o) for o in outs)
    return {"output_tokens": tokens, "seconds": secs, "tok_s": tokens / secs, "token_ids": outs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model and few requests: a smoke run on the CPU")
    args = ap.parse_args()
    if args.small:
        global REQUESTS_AT_1, CONCURRENCY, OUTPUT_LEN
        ARCH.update(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        )
        REQUESTS_AT_1, CONCURRENCY, OUTPUT_LEN = 2, 4, 8
    torch.backends.cuda.matmul.allow_tf32 = True
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "model": ARCH,
        "prompt_len": PROMPT_LEN,
        "output_len": OUTPUT_LEN,
        "requests_at_1": REQUESTS_AT_1,
        "concurrency": CONCURRENCY,
        "results": {},
        "errors": [],
    }
    prompts = {1: make_prompts(REQUESTS_AT_1, seed=1), CONCURRENCY: make_prompts(CONCURRENCY, seed=2)}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # Random weights drawn on the device (on a GPU: seconds for a billion parameters), in bfloat16.
        _, report["write_model_s"] = timed(
            lambda: write_random_llama(folder, ARCH, torch.bfloat16, args.device, embed_std=0.5)
        )
        cases = [
            ("baton_bf16", {}),
            ("baton_bf16_fp8kv", {"kv_cache_dtype": "fp8"}),
            ("baton_fp8_fp8kv", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
        ]
        for name, kwargs in cases:
            for concurrency in (1, CONCURRENCY):
                key = f"{name}@{concurrency}"
                try:
                    report["results"][key] = run_baton(folder, args.device, concurrency, prompts[concurrency], **kwargs)
                    print(key, f"{report['results'][key]['tok_s']:.0f} tok/s", flush=True)
                except Exception:
                    report["errors"].append(f"{key}: {traceback.format_exc()[-2000:]}")
                    print(report["errors"][-1], flush=True)
        try:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(args.device).eval()
            model.generation_config.eos_token_id = None
            for concurrency in (1, CONCURRENCY):
                key = f"transformers_bf16@{concurrency}"
                report["results"][key] = run_transformers(model, args.device, concurrency, prompts[concurrency])
                print(key, f"{report['results'][key]['tok_s']:.0f} tok/s", flush=True)
        except Exception:
            report["errors"].append(f"transformers: {traceback.format_exc()[-2000:]}")
            print(report["errors"][-1], flush=True)
    results = report["results"]
    for concurrency in (1, CONCURRENCY):
        base = results.get(f"transformers_bf16@{concurrency}")
        for name, _ in cases:
            ours = results.get(f"{name}@{concurrency}")
            if base and ours:
                ours["vs_transformers"] = ours["tok_s"] / base["tok_s"]
        ours = results.get(f"baton_bf16@{concurrency}")
        if base and ours:
            same = [
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(ours["token_ids"], base["token_ids"])
            ]
            report[f"vs_transformers_same_tokens_before_divergence@{concurrency}"] = same
    for r in results.values():
        r.pop("token_ids", None)
    report["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "model"}, indent=2))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
