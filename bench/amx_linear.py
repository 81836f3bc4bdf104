"""float32 prompt projections as bf16x3 on AMX (kernels/amx_linear.py) against float32 FMAs
(kernels/small_m_linear.py, what decode rows and `--float32-prompt-matmul ieee` run).

Two measurements, each taking turns between the two so that the load of a shared machine hits both:

- the kernels on the default model's projection shapes (SmolLM2-135M: qkv 960x576, o 576x576,
  gate_up 3072x576, down 576x1536), for prompt-sized row counts: milliseconds for one layer's four
  projections and the error against float64 (largest |difference| over the mean |output|), with
  plain bfloat16 products beside for scale;
- the engine: CPU seconds of one 2,000-token prompt's prefill (the default model in float32, one
  thread, the default step budget), `float32_prompt_matmul` ieee against bf16x3.

    .venv/bin/python -m bench.amx_linear [--rows 256 2048] [--reps 5] [--prompt 2000]

Writes bench/results/amx_linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from cluster.busy_host import cpu_name
from common.sampling_params import SamplingParams
from kernels import amx_linear, small_m_linear
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().mean())


def kernels(rows: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    weights = {name: torch.randn(n, k, generator=gen) * k**-0.5 for name, (n, k) in LAYER_SHAPES.items()}
    inputs = {name: torch.randn(rows, w.shape[1], generator=gen) for name, w in weights.items()}
    packed = {name: small_m_linear.pack_weight(w) for name, w in weights.items()}
    tiles = {name: amx_linear.pack_weight(p) for name, p in packed.items()}
    errors = {"float32": 0.0, "bf16x3": 0.0, "bfloat16": 0.0}
    for name, w in weights.items():
        exact = torch.nn.functional.linear(inputs[name].double(), w.double())
        errors["float32"] = max(
            errors["float32"],
            relative_error(small_m_linear.small_m_linear_cpu(inputs[name], packed[name], None), exact),
        )
        errors["bf16x3"] = max(
            errors["bf16x3"], relative_error(amx_linear.amx_linear_cpu(inputs[name], tiles[name]), exact)
        )
        plain = torch.nn.functional.linear(inputs[name].bfloat16().double(), w.bfloat16().double())
        errors["bfloat16"] = max(errors["bfloat16"], relative_error(plain, exact))

    def layer(fn, weights_of) -> float:
        start = time.perf_counter()
        for name in LAYER_SHAPES:
            fn(inputs[name], weights_of[name])
        return time.perf_counter() - start

    ieee, bf16x3 = [], []
    for _ in range(reps + 1):  # the first of each is a warm-up
        ieee.append(layer(lambda x, w: small_m_linear.small_m_linear_cpu(x, w, None), packed))
        bf16x3.append(layer(amx_linear.amx_linear_cpu, tiles))
    flops = sum(2 * rows * n * k for n, k in LAYER_SHAPES.values())
    best_ieee, best_x3 = min(ieee[1:]), min(bf16x3[1:])
    return {
        "rows": rows,
        "ieee_ms": best_ieee * 1e3,
        "bf16x3_ms": best_x3 * 1e3,
        "speedup": best_ieee / best_x3,
        "ieee_gflop_per_s": flops / best_ieee / 1e9,
        "bf16x3_gflop_per_s": flops / best_x3 / 1e9,
        "error_over_mean_output": errors,
    }


def prefill_cpu_seconds(engines: dict[str, LLMEngine], prompt: int, reps: int) -> dict:
    rng = random.Random(0)

    def once(engine: LLMEngine) -> float:
        engine.add_request(
            [rng.randrange(100, 40000) for _ in range(prompt)], SamplingParams(max_tokens=1, temperature=0.0)
        )
        start = time.process_time()
        while engine.has_unfinished_requests():
            engine.step()
        return time.process_time() - start

    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(reps + 1):
        for mode, engine in engines.items():
            times[mode].append(once(engine))
    best = {mode: min(t[1:]) for mode, t in times.items()}
    return {"prompt_tokens": prompt, "cpu_s": best, "all_cpu_s": times, "speedup": best["ieee"] / best["bf16x3"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=2000, help="the engine's prompt length (0: skip the engine)")
    ap.add_argument("--out", default="bench/results/amx_linear.json")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows) or args.reps < 1 or args.prompt < 0:
        ap.error("--rows and --reps must be positive, --prompt at least 0")
    if not amx_linear.ready():
        sys.exit(
            "the AMX linear kernel does not run here: it needs an x86-64 CPU with AMX-BF16 (Sapphire Rapids "
            "or later) and g++"
        )
    torch.set_num_threads(1)
    doc = {
        "benchmark": "float32 prompt projections: bf16x3 on AMX against float32 FMAs",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([sys.executable, *sys.argv]),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": 1,
        "loadavg_before": list(os.getloadavg()),
        "kernels": [],
    }
    for rows in args.rows:
        doc["kernels"].append(kernels(rows, args.reps))
        print(json.dumps(doc["kernels"][-1]), flush=True)
    if args.prompt:
        engines = {
            mode: load_engine(
                None,
                EngineConfig(
                    dtype="float32", kv_cache_memory=512 << 20, enable_prefix_caching=False, float32_prompt_matmul=mode
                ),
            )
            for mode in ("ieee", "bf16x3")
        }
        doc["engine_prefill"] = prefill_cpu_seconds(engines, args.prompt, max(2, args.reps // 2))
        doc["engine_prefill"]["step_budget"] = engines["ieee"].config.max_num_batched_tokens
        print(json.dumps(doc["engine_prefill"]), flush=True)
    doc["loadavg_after"] = list(os.getloadavg())
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
