"""Native CPU paged attention with and without a sliding window: the kernels skip the blocks before
the window, so a 512-token window over an 8192-token context should cost about a sixteenth.

`.venv/bin/python -m bench.sliding_window` writes bench/results/sliding_window_cpu.json (median of
repeats, one thread).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from kernels.decode_attention import paged_decode_attention_cpu
from kernels.prefill_attention import paged_prefill_attention_cpu

BS, HK, HQ, D, CTX, BATCH, WINDOW, CHUNK = 16, 4, 8, 128, 8192, 4, 512, 256


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    # One thread: on a shared machine an OpenMP barrier waiting for a descheduled thread dominates
    # a sub-millisecond kernel and hides what the window saves.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nb = BATCH * CTX // BS
    k, v = torch.randn(nb, BS, HK, D), torch.randn(nb, BS, HK, D)
    bt = torch.arange(nb, dtype=torch.int32).reshape(BATCH, -1)
    lens = torch.full((BATCH,), CTX, dtype=torch.int32)
    q = torch.randn(BATCH, HQ, D)
    qp = torch.randn(CHUNK, HQ, D)
    qsl = torch.tensor([0, CHUNK], dtype=torch.int32)
    one = torch.tensor([CTX], dtype=torch.int32)
    result = dict(
        batch=BATCH,
        context=CTX,
        window=WINDOW,
        prefill_chunk=CHUNK,
        num_q_heads=HQ,
        num_kv_heads=HK,
        head_dim=D,
        block_size=BS,
        threads=torch.get_num_threads(),
    )
    result["decode_full_ms"] = median_ms(lambda: paged_decode_attention_cpu(q, k, v, bt, lens, 0.08), 30)
    result["decode_window_ms"] = median_ms(
        lambda: paged_decode_attention_cpu(q, k, v, bt, lens, 0.08, window=WINDOW), 30
    )
    result["decode_window_softcap_ms"] = median_ms(
        lambda: paged_decode_attention_cpu(q, k, v, bt, lens, 0.08, window=WINDOW, softcap=50.0), 30
    )
    result["prefill_full_ms"] = median_ms(lambda: paged_prefill_attention_cpu(qp, k, v, bt[:1], qsl, one, 0.08), 7)
    result["prefill_window_ms"] = median_ms(
        lambda: paged_prefill_attention_cpu(qp, k, v, bt[:1], qsl, one, 0.08, window=WINDOW), 7
    )
    out = Path(__file__).resolve().parent / "results" / "sliding_window_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
