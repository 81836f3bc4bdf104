"""The float32 linear kernel for decode-sized batches (kernels/small_m_linear.py) against oneDNN's
prepacked linear, the engine's path before it, on the default model's linear shapes.

A CPU decode step of the default model in float32 spends about 60% of its time in the linear
layers (`bench/decode_profile.py`), and with 16 rows oneDNN's prepacked linear is neither bound by
memory bandwidth nor by the FMA units: on the 2-core Intel host it streamed 8 GB/s where one row
streams 12. This times the whole set of the model's linear layers as the engine runs them (30
layers of qkv, o, gate_up and down, and the lm_head) for several row counts, the two taking turns,
and checks the kernel against float64 on the way. Writes
bench/results/issue29_attempts/small_m_linear.json.

    .venv/bin/python -m bench.small_m_linear [--rows 1 8 16 32] [--reps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from common.stats import percentile
from kernels.small_m_linear import native_built, pack_weight, small_m_linear_cpu
from workers.quantization.packed_linear import onednn_pack, packed_linear

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, 30 layers, vocabulary 49152;
# the layers as the engine runs them, q/k/v and gate/up fused.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, LM_HEAD = 30, (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/issue29_attempts/small_m_linear.json")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows) or args.reps < 1 or args.threads < 1:
        ap.error("--rows, --reps and --threads must be positive")
    if not native_built():
        sys.exit("the native small_m_linear kernel does not build on this machine (needs g++ and x86-64)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    weights = [torch.randn(n, k) * k**-0.5 for n, k in shapes]
    onednn = [onednn_pack(w) for w in weights]
    native = [pack_weight(w) for w in weights]
    weight_bytes = sum(w.numel() * 4 for w in weights)
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        worst = 0.0
        for (_n, k), w, wn in zip(shapes[:4] + shapes[-1:], weights[:4] + weights[-1:], native[:4] + native[-1:]):
            exact = torch.nn.functional.linear(inputs[k].double(), w.double())
            got = small_m_linear_cpu(inputs[k], wn, None).double()
            worst = max(worst, ((got - exact).abs().max() / exact.abs().max()).item())
        times: dict[str, list[float]] = {"onednn_prepacked": [], "small_m_kernel": []}
        for _ in range(args.reps):  # the two take turns, so both meet the same machine
            started = time.perf_counter()
            for (_n, k), w in zip(shapes, onednn):
                packed_linear(inputs[k], w, None)
            times["onednn_prepacked"].append(time.perf_counter() - started)
            started = time.perf_counter()
            for (_n, k), w in zip(shapes, native):
                small_m_linear_cpu(inputs[k], w, None)
            times["small_m_kernel"].append(time.perf_counter() - started)
        ms = {name: round(1000 * percentile(t, 50), 2) for name, t in times.items()}
        results.append(
            {
                "rows": rows,
                "step_linear_ms_p50": ms,
                "ratio": round(ms["small_m_kernel"] / ms["onednn_prepacked"], 3),
                "small_m_kernel_gb_per_s": round(weight_bytes / ms["small_m_kernel"] / 1e6, 2),
                "max_error_relative_to_largest_output": worst,
            }
        )
        print(
            f"rows {rows}: oneDNN {ms['onednn_prepacked']} ms, kernel {ms['small_m_kernel']} ms "
            f"({results[-1]['ratio']}x), max relative error {worst:.1e}"
        )
    out = {
        "benchmark": "small_m_linear",
        "command": "python -m bench.small_m_linear " + " ".join(sys.argv[1:]),
        "weight_bytes": weight_bytes,
        "threads": args.threads,
        "reps": args.reps,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
