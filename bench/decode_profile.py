"""Where one decode step of the engine goes, by category, with and without the native CPU kernels.

    .venv/bin/python -m bench.decode_profile [--batch 16] [--context 256] [--steps 20]
        [--out bench/results/decode_profile.json]

Setup: the default model, one torch thread (as one worker of `baton serve` on this 2-core
machine; `--threads 2` as a decode worker that borrowed the idle prefill worker's core), `--batch`
sequences of `--context` random prompt tokens, prefilled, then `--steps`
decode steps timed (wall clock, no profiler) and the same number again under cProfile for the
split. Runs for float32 (four ways) and bfloat16 (the first three): "before" (EngineConfig kernel_backend
"reference" and packed_linear False: PyTorch references and plain F.linear, the engine before
this work), with the native kernels (kernel_backend "auto": attention, RMSNorm, rotary, KV store,
SiLU-and-mul in kernels/csrc), with those plus prepacked linear layers (workers/quantization/packed_linear.py),
and, in float32, with each step's decoder layers in one native call (kernels/layer_stack.py; the
default, which `--enforce-eager` turns off).

Categories are cumulative times of the kernels' entry points (each includes its argument
checks): linear layers (torch's linear, lm_head included), attention, norm / rotary / KV store /
SiLU, sampling; "python and scheduling" is the rest of the step (module calls, batch building,
scheduler, detokenizing). cProfile's per-call cost inflates the python share; the table scales
every category so the total matches the unprofiled step time. Transport and streaming are not
part of an engine step: bench/kv_transfer.py and bench/stream_overhead.py measure them.

Also timed: the same decode step with the batch's pages scattered over the cache (the free block
list shuffled first, as in a server that has recycled its blocks), and every linear layer applied
to a single row, which is what streaming the weights from memory once costs (the floor under any
decode step at any batch size).

Prefill is timed too, outside the split: one `--long-prompt` prompt alone (default 2,000 tokens),
then the `--batch` prompts together (chunked under the engine's default 256-token budget).

`--prefill` measures only where a long prompt's prefill goes (bench/results/prefill_profile.json):
per dtype, the CPU time of one `--long-prompt` prefill under token budgets of 256 (the default)
and 2,048, its cProfile split (linear layers, attention, the rest), and the native prefill
attention kernel alone over the same chunks (GFLOP/s of the causal QK and PV products). With
`--baseline-kernel SRC.cpp` (e.g. `git show e27f49d:kernels/csrc/paged_prefill_attention.cpp`)
that kernel source is built and timed beside the current one in the same run. CPU time
(time.process_time), not wall time, since other processes share the machine.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import os
import pstats
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch

from cluster.busy_host import cpu_name
from common.sampling_params import SamplingParams
from kernels import cpu_native, prefill_attention
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.quantization.fp8 import weight_memory
from workers.quantization.packed_linear import PackedLinear


def _kernel(module: str, op: str) -> list[tuple[str, str]]:
    """An op's native, reference and Triton entry points in kernels/{module}.py."""
    return [(f"kernels/{module}.py", f"{op}_{impl}") for impl in ("cpu", "reference", "triton")]


# Per category, the (file suffix, function name) entries whose cumulative times are summed.
CATEGORIES = {
    "linear layers": [("", "torch._C._nn.linear"), ("workers/quantization/packed_linear.py", "packed_linear")],
    "attention": _kernel("decode_attention", "paged_decode_attention")
    + _kernel("prefill_attention", "paged_prefill_attention"),
    "norm, rotary, KV store, SiLU": _kernel("rms_norm", "rms_norm")
    + _kernel("rotary", "rotary_embedding")
    + _kernel("kv_store", "store_kv")
    + _kernel("silu_mul", "silu_and_mul"),
    "sampling": [("workers/engine/sampler.py", "sample")],
    # A float32 step's layers, linear layers and attention included, when they run as one call.
    "decoder layers in one call": [("kernels/layer_stack.py", "run")],
}


def prefill_seconds(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Wall time until every prompt has its first token (the requests stay, decoding)."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return time.perf_counter() - start


def build_engine(
    dtype: str,
    batch: int,
    context: int,
    long_prompt: int,
    native: bool = True,
    packed: bool = True,
    scatter_pages: bool = False,
    one_call: bool = True,
) -> tuple[LLMEngine, dict]:
    """An engine decoding `batch` sequences, and how long the prefills took (not part of the split).

    scatter_pages: shuffle the free block list first, which is what a server's cache looks like
    once it has recycled its blocks for a while: each sequence's pages land all over the cache."""
    config = EngineConfig(
        dtype=dtype,
        max_num_seqs=batch,
        kv_cache_memory=512 << 20,
        kernel_backend="auto" if native else "reference",
        packed_linear=packed,
        enforce_eager=not one_call,
    )
    engine = load_engine(None, config)
    if scatter_pages:
        free = engine.block_manager._free
        order = list(free)
        random.Random(1).shuffle(order)
        free.clear()
        free.update((block_id, None) for block_id in order)
    rng = random.Random(0)
    timings = {}
    if long_prompt:
        timings[f"prefill_1x{long_prompt}_s"] = prefill_seconds(
            engine, [[rng.randrange(100, 40000) for _ in range(long_prompt)]], 1
        )
        engine.step()  # the long request finishes and leaves the batch
    prompts = [[rng.randrange(100, 40000) for _ in range(context)] for _ in range(batch)]
    timings[f"prefill_{batch}x{context}_s"] = prefill_seconds(engine, prompts, 10_000)
    for _ in range(3):
        engine.step()
    return engine, timings


def split(profile: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    total = sum(v[2] for v in stats.values())
    out = {}
    for category, entries in CATEGORIES.items():
        seconds = 0.0
        for (file, _line, name), value in stats.items():
            for want_file, want_name in entries:
                if file.endswith(want_file) and (name == want_name or name == f"<built-in method {want_name}>"):
                    seconds += value[3]
        out[category] = seconds
    out["python and scheduling"] = max(0.0, total - sum(out.values()))
    return out


def linear_layers_one_row(model: torch.nn.Module, dtype: str) -> dict:
    """Every linear layer (lm_head included) applied to one row: what streaming the weights once
    costs, the floor under any decode step. Best of 5, since nothing else varies."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    lm_head = model.lm_head_weight
    nbytes = weight_memory(model).linear_bytes + lm_head.numel() * lm_head.element_size()
    inputs = {m.in_features: torch.randn(1, m.in_features).to(getattr(torch, dtype)) for m in layers}
    hidden = torch.randn(1, model.config.hidden_size).to(getattr(torch, dtype))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            start = time.perf_counter()
            for m in layers:
                m(inputs[m.in_features])
            model.compute_logits(hidden)
            best = min(best, time.perf_counter() - start)
    return {"ms": best * 1000, "weight_bytes": nbytes, "gb_per_s": nbytes / best / 1e9}


def step_ms(engine: LLMEngine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1000


def measure(dtype: str, native: bool, packed: bool, one_call: bool, args) -> dict:
    scattered_ms = step_ms(
        build_engine(dtype, args.batch, args.context, 0, native, packed, scatter_pages=True, one_call=one_call)[0],
        args.steps,
    )
    engine, prefill = build_engine(dtype, args.batch, args.context, args.long_prompt, native, packed, one_call=one_call)
    in_order_ms = step_ms(engine, args.steps)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    parts = split(profile)
    scale = in_order_ms / (sum(parts.values()) / args.steps * 1000)
    ms = {k: v / args.steps * 1000 * scale for k, v in parts.items()}
    return {
        "dtype": dtype,
        "native_kernels": native,
        "packed_linear": packed,
        "one_call": engine.runner.layer_stack is not None,
        "step_ms": in_order_ms,
        "tokens_per_s": args.batch / in_order_ms * 1000,
        "split_ms": ms,
        "prefill": prefill,
        "step_ms_scattered_pages": scattered_ms,
        "linear_layers_one_row": linear_layers_one_row(engine.runner.model, dtype),
    }


def prefill_cpu_seconds(dtype: str, budget: int, n: int, profile: bool = False) -> dict:
    """CPU seconds of one n-token prefill (best of 2) under `budget` tokens a step; with profile,
    the cProfile split of a third run too."""
    config = EngineConfig(
        dtype=dtype, max_num_batched_tokens=budget, kv_cache_memory=512 << 20, enable_prefix_caching=False
    )
    engine = load_engine(None, config)
    rng = random.Random(0)

    def run() -> None:
        engine.add_request([rng.randrange(100, 40000) for _ in range(n)], SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()

    run()  # warm-up (kernel build, first-call costs)
    best = float("inf")
    for _ in range(2):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    out = {"dtype": dtype, "budget": budget, "prompt_tokens": n, "cpu_s": best}
    if profile:
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        run()
        prof.disable()
        parts = split(prof)
        out["split_s"] = {
            "linear layers": parts["linear layers"],
            "attention": parts["attention"],
            "everything else": sum(v for k, v in parts.items() if k not in ("linear layers", "attention")),
        }
    return out


def attention_gflops(dtype: str, n: int, chunk: int, fn=None) -> dict:
    """The native prefill attention kernel alone over an n-token prompt's chunks (SmolLM2's 9 query
    / 3 KV heads of 64), as 30 layers would run it: CPU seconds, and GFLOP/s of QK and PV."""
    torch_dtype = getattr(torch, dtype)
    hq, hk, d, bs = 9, 3, 64, 16
    nb = -(-n // bs)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(nb, bs, hk, d, generator=g).to(torch_dtype)
    v = torch.randn(nb, bs, hk, d, generator=g).to(torch_dtype)
    table = torch.arange(nb, dtype=torch.int32)[None]
    chunks = [
        (c0, min(chunk, n - c0), torch.randn(min(chunk, n - c0), hq, d, generator=g).to(torch_dtype))
        for c0 in range(0, n, chunk)
    ]
    real = prefill_attention._native_fn
    if fn is not None:
        prefill_attention._native_fn = lambda: fn
    try:

        def one_layer() -> float:
            start = time.process_time()
            for c0, m, q in chunks:
                prefill_attention.paged_prefill_attention_cpu(
                    q,
                    k,
                    v,
                    table,
                    torch.tensor([0, m], dtype=torch.int32),
                    torch.tensor([c0 + m], dtype=torch.int32),
                    0.125,
                )
            return time.process_time() - start

        one_layer()
        best = min(one_layer() for _ in range(5))
    finally:
        prefill_attention._native_fn = real
    flops = sum(4 * hq * d * sum(range(c0 + 1, c0 + m + 1)) for c0, m, _ in chunks)
    return {"cpu_s_30_layers": best * 30, "gflop_per_s": flops / best / 1e9}


def baseline_kernel(source: str):
    """The prefill attention entry point built from another source file (same flags)."""
    folder = Path(tempfile.mkdtemp(prefix="baton-baseline-"))
    for header in cpu_native.SOURCE_DIR.glob("*.h"):  # the source includes them from its own folder
        shutil.copy(header, folder)
    shutil.copy(source, folder / "baseline.cpp")
    target = folder / "baseline.so"
    cpu_native._compile(cpu_native.compiler(), folder / "baseline.cpp", target)
    fn = ctypes.CDLL(str(target)).baton_paged_prefill_attention
    fn.argtypes = list(prefill_attention._NATIVE_ARGS)
    fn.restype = ctypes.c_int
    return fn


def prefill_profile(args) -> None:
    baseline = baseline_kernel(args.baseline_kernel) if args.baseline_kernel else None
    runs = []
    for dtype in ("float32", "bfloat16"):
        kernel = {"current": attention_gflops(dtype, args.long_prompt, 256)}
        if baseline is not None:
            kernel["baseline"] = attention_gflops(dtype, args.long_prompt, 256, baseline)
        runs.append(
            {
                "dtype": dtype,
                "attention_kernel": kernel,
                "budgets": [
                    prefill_cpu_seconds(dtype, 256, args.long_prompt, profile=True),
                    prefill_cpu_seconds(dtype, 2048, args.long_prompt, profile=True),
                ],
            }
        )
        print(json.dumps(runs[-1], indent=1), flush=True)
    doc = {
        "benchmark": "long-prompt prefill profile",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([sys.executable, *sys.argv]),
        "torch_threads": 1,
        "clock": "process CPU time",
        "baseline_kernel": args.baseline_kernel,
        "loadavg": list(os.getloadavg()),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--long-prompt", type=int, default=2000, help="also time one prompt this long (0: skip)")
    ap.add_argument(
        "--out", default=None, help="default bench/results/decode_profile.json (prefill_profile.json with --prefill)"
    )
    ap.add_argument("--prefill", action="store_true", help="only the long prompt's prefill profile (see above)")
    ap.add_argument("--baseline-kernel", default=None, help="with --prefill: a prefill attention source to time too")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (a decode worker that borrows an idle core runs on 2 here: workers.shell.elastic_threads)",
    )
    ap.add_argument("--default-only", action="store_true", help="only the engine's default configuration")
    ap.add_argument(
        "--eager-too",
        action="store_true",
        help="with --default-only: float32 layer by layer (--enforce-eager) too, beside the one call",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.prefill:
        args.out = args.out or str(REPO / "bench" / "results" / "prefill_profile.json")
        prefill_profile(args)
        return
    args.out = args.out or str(REPO / "bench" / "results" / "decode_profile.json")
    # (native kernels, packed linears, decoder layers in one call); bfloat16 never takes the one
    # call (its linear layers are oneDNN's), so its full run leaves that row out.
    default = (True, True, True)
    eager = (True, True, False)
    variants = {
        dtype: ([eager] if args.eager_too and dtype == "float32" else []) + [default]
        if args.default_only
        else [(False, False, False), (True, False, False), (True, True, False)]
        + ([default] if dtype == "float32" else [])
        for dtype in ("float32", "bfloat16")
    }
    runs = [measure(dtype, *variant, args) for dtype in ("float32", "bfloat16") for variant in variants[dtype]]
    print(f"decode step, {args.batch} sequences of ~{args.context} tokens, {args.threads} thread(s) (ms)")
    cats = list(runs[0]["split_ms"])
    print("| config | step | step, scattered pages | " + " | ".join(cats) + " | prefill (s) |")
    print("|---|---:|---:|" + "---:|" * len(cats) + "---|")
    for r in runs:
        label = r["dtype"] + (
            ", + decoder layers in one call"
            if r["one_call"]
            else ", + prepacked linears"
            if r["packed_linear"]
            else ", + native kernels"
            if r["native_kernels"]
            else ", before (PyTorch references)"
        )
        print(
            f"| {label} | {r['step_ms']:.1f} | {r['step_ms_scattered_pages']:.1f} | "
            + " | ".join(f"{r['split_ms'][c]:.1f}" for c in cats)
            + " | "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["prefill"].items())
            + " |"
        )
    doc = {
        "benchmark": "decode step profile",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([sys.executable, *sys.argv]),
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "torch_threads": args.threads,
        "machine": {"cpu": cpu_name()},
        "loadavg": list(os.getloadavg()),
        "runs": runs,
    }
    for r in runs:
        one = r["linear_layers_one_row"]
        print(
            f"{r['dtype']}, native {r['native_kernels']}, packed {r['packed_linear']}: linear layers at one row "
            f"{one['ms']:.1f} ms ({one['weight_bytes'] / 1e6:.0f} MB of weights, {one['gb_per_s']:.1f} GB/s)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
