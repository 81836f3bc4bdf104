"""Probe: a float32 linear kernel for decode-sized batches against oneDNN's prepacked linear.

A CPU decode step of the default model in float32 spends about 60% of its time in the linear
layers (`bench/decode_profile.py`), and with 16 rows oneDNN's prepacked linear (what the engine
uses, workers/packed_linear.py) is neither bound by memory bandwidth nor by the FMA units: on the
2-core Intel host it streamed 8 GB/s where one row streams 12. This probe times a small kernel
written for that case against it, on the default model's linear shapes (30 layers of q, k, v, o,
gate, up, down, and the lm_head), one thread, for several row counts:

- the weight is packed as [N / 16][K][16] (16 outputs side by side for each k), so one panel of
  outputs streams from memory in one sequential run;
- a register block of 8 rows x 48 outputs (24 accumulators; each broadcast of x feeds 3 FMAs);
- the rows in blocks of 8 over the same panel, the later blocks reading it from L2, and while the
  last block computes, the next panel is prefetched into L2.

Not used by the engine: it measures whether such a kernel is worth building. Needs g++ with
AVX-512 (x86-64); writes bench/results/issue29_attempts/small_m_linear.json.

    .venv/bin/python -m bench.small_m_linear [--rows 1 8 16 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.stats import percentile  # noqa: E402
from workers.packed_linear import pack, packed_linear  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <cstdint>
// y[M,N] = x[M,K] . W^T with W packed as [N/16][K][16]; N a multiple of 16.
template <int MB, int NB>
static inline void panel(const float* x, int64_t rows, const float* w, float* y, int64_t K, int64_t N,
                         int64_t n0, const float* next) {
    __m512 acc[MB][NB];
    for (int m = 0; m < MB; ++m) for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __m512 wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(w + (b * K + k) * 16);
        if (next) for (int b = 0; b < NB; ++b) _mm_prefetch((const char*)(next + (b * K + k) * 16), _MM_HINT_T1);
        for (int m = 0; m < MB; ++m) {
            const __m512 xv = _mm512_set1_ps(x[m * K + k]);
            for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xv, wv[b], acc[m][b]);
        }
    }
    for (int m = 0; m < MB; ++m) for (int b = 0; b < NB; ++b) _mm512_storeu_ps(y + m * N + n0 + b * 16, acc[m][b]);
    (void)rows;
}
template <int NB>
static void columns(const float* x, int64_t M, const float* w, float* y, int64_t K, int64_t N, int64_t n0,
                    const float* next) {
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) panel<8, NB>(x + m * K, 8, w, y + m * N, K, N, n0, m + 8 >= M ? next : nullptr);
    for (; m < M; ++m) panel<1, NB>(x + m * K, 1, w, y + m * N, K, N, n0, m + 1 >= M ? next : nullptr);
}
extern "C" void small_m_linear(const float* x, int64_t M, const float* wp, float* y, int64_t K, int64_t N) {
    const int64_t blocks = N / 16;
    int64_t nb = 0;
    for (; nb + 3 <= blocks; nb += 3)
        columns<3>(x, M, wp + nb * K * 16, y, K, N, nb * 16, nb + 6 <= blocks ? wp + (nb + 3) * K * 16 : nullptr);
    for (; nb < blocks; ++nb) columns<1>(x, M, wp + nb * K * 16, y, K, N, nb * 16, nullptr);
}
"""

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, 30 layers, vocabulary 49152.
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, LM_HEAD = 30, (49152, 576)


def build(folder: Path) -> ctypes.CDLL:
    src, lib = folder / "small_m_linear.cpp", folder / "small_m_linear.so"
    src.write_text(SOURCE)
    subprocess.run(["g++", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    library = ctypes.CDLL(str(lib))
    library.small_m_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64]
    return library


def native_layout(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/issue29_attempts/small_m_linear.json")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows) or args.reps < 1:
        ap.error("--rows and --reps must be positive")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    weights = [torch.randn(n, k) * k ** -0.5 for n, k in shapes]
    onednn = [pack(w) for w in weights]
    native = [native_layout(w) for w in weights]
    weight_bytes = sum(w.numel() * 4 for w in weights)
    with tempfile.TemporaryDirectory(prefix="baton-small-m-") as tmp:
        lib = build(Path(tmp))

        def run_native(x: torch.Tensor, w: torch.Tensor, n: int, k: int) -> torch.Tensor:
            y = torch.empty(x.shape[0], n)
            lib.small_m_linear(x.data_ptr(), x.shape[0], w.data_ptr(), y.data_ptr(), k, n)
            return y

        results = []
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
            worst = 0.0
            for (n, k), w, wn in zip(shapes[:8] + shapes[-1:], weights[:8] + weights[-1:], native[:8] + native[-1:]):
                exact = torch.nn.functional.linear(inputs[k].double(), w.double())
                got = run_native(inputs[k], wn, n, k).double()
                worst = max(worst, ((got - exact).abs().max() / exact.abs().max()).item())
            times: dict[str, list[float]] = {"onednn_prepacked": [], "small_m_kernel": []}
            for _ in range(args.reps):  # the two take turns, so both meet the same machine
                started = time.perf_counter()
                for (n, k), w in zip(shapes, onednn):
                    packed_linear(inputs[k], w, None)
                times["onednn_prepacked"].append(time.perf_counter() - started)
                started = time.perf_counter()
                for (n, k), w in zip(shapes, native):
                    run_native(inputs[k], w, n, k)
                times["small_m_kernel"].append(time.perf_counter() - started)
            ms = {name: round(1000 * percentile(t, 50), 2) for name, t in times.items()}
            results.append({"rows": rows, "step_linear_ms_p50": ms,
                            "ratio": round(ms["small_m_kernel"] / ms["onednn_prepacked"], 3),
                            "small_m_kernel_gb_per_s": round(weight_bytes / ms["small_m_kernel"] / 1e6, 2),
                            "max_error_relative_to_largest_output": worst})
            print(f"rows {rows}: oneDNN {ms['onednn_prepacked']} ms, kernel {ms['small_m_kernel']} ms "
                  f"({results[-1]['ratio']}x), max relative error {worst:.1e}")
    out = {"benchmark": "small_m_linear", "command": "python -m bench.small_m_linear " + " ".join(sys.argv[1:]),
           "weight_bytes": weight_bytes, "threads": 1, "reps": args.reps, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
