"""What the sums inside the shm sender's copy cost on KV blocks as a prefill leaves them.

`bench.kv_transfer --checksum-cost` moves its block ids every repetition so that no copy finds its
data in the CPU caches. A prefill worker sends blocks its model wrote moments before, which may
still be in the caches, where the sums cost less. This measures that case: the default model's
engine (float32, the model's own KV layout) prefills a fresh random prompt of about 16 MiB of KV
(`prefill_only`, as a prefill worker does) and its blocks are copied right away into a second
cache with the native copy that sums as it copies (kernels.block_checksum.SummingCopier, what a
sender with checksums on runs), or with the same copy without the sums (checksums off). The two
take turns, one prefill each; then the same again after reading 256 MiB of other memory (cold).

    .venv/bin/python -m bench.kv_checksum_after_prefill   # -> bench/results/kv_checksum_after_prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from array import array
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from cluster.busy_host import cpu_name
from common.sampling_params import SamplingParams
from common.stats import percentile, percentiles
from kernels.block_checksum import SummingCopier
from workers.build import load_engine
from workers.config import EngineConfig
from workers.models.files import resolve_model_dir

TARGET_BYTES = 16 << 20
EVICT_BYTES = 256 << 20
CASES = (("sums", "after prefill"), ("no sums", "after prefill"), ("sums", "cold"), ("no sums", "cold"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=24, help="prefills per case")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_checksum_after_prefill.json"))
    args = parser.parse_args()
    model_dir = resolve_model_dir(quiet=True)
    engine = load_engine(
        model_dir, EngineConfig(dtype="float32", kv_cache_memory=512 << 20, enable_prefix_caching=False)
    )
    cache = engine.runner.kv_cache  # [layers, K/V, blocks, block_size, kv heads, head_dim]
    bytes_per_token = cache[0, 0, 0, 0].numel() * cache.element_size() * cache.shape[0] * cache.shape[1]
    prompt_len = TARGET_BYTES // bytes_per_token
    copier = SummingCopier(torch.empty_like(cache), cache)
    other = np.ones(EVICT_BYTES, np.uint8)
    rng = random.Random(0)
    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in CASES}
    prefill_seconds: list[float] = []  # what the sums cost is set against: the prefill that wrote the blocks
    nbytes = 0
    load_before = os.getloadavg()
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for sums, when in CASES if rep % 2 else CASES[::-1]:
            rid = f"{rep}-{sums}-{when}"
            engine.add_request(
                [rng.randrange(100, 40_000) for _ in range(prompt_len)],
                SamplingParams(max_tokens=16),
                rid,
                prefill_only=True,
            )
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            if rep:
                prefill_seconds.append(time.perf_counter() - start)
            ids = array("q", engine.held_block_ids(rid))
            if when == "cold":
                other.sum()
            start = time.perf_counter()
            copier(ids, ids, sums=sums == "sums")
            if rep:
                seconds[(sums, when)].append(time.perf_counter() - start)
            nbytes = len(ids) * cache[:, :, 0].numel() * cache.element_size()
            engine.release(rid)
    medians = {f"{sums}, {when}": percentile(t, 50) for (sums, when), t in seconds.items()}
    report = {
        "benchmark": "kv_checksum_after_prefill",
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": ".venv/bin/python -m bench.kv_checksum_after_prefill",
        "machine": {
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_1_5_15_before": list(load_before),
            "load_average_1_5_15": list(os.getloadavg()),
        },
        "model": model_dir.name,
        "kv_cache_shape": list(cache.shape),
        "kv_dtype": str(cache.dtype).removeprefix("torch."),
        "prompt_tokens": prompt_len,
        "bytes_copied": nbytes,
        "reps": args.reps,
        "copy_seconds_median": medians,
        "copy_seconds_quartiles": {f"{sums}, {when}": percentiles(t, (25, 75)) for (sums, when), t in seconds.items()},
        "sums_overhead": {
            when: medians[f"sums, {when}"] / medians[f"no sums, {when}"] - 1 for when in ("after prefill", "cold")
        },
        "prefill_seconds_median": percentile(prefill_seconds, 50),
        # the sums' time after a prefill, as a share of that prefill's
        "sums_share_of_prefill": (medians["sums, after prefill"] - medians["no sums, after prefill"])
        / percentile(prefill_seconds, 50),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for case, median in medians.items():
        print(f"{case:24s} {median * 1e3:7.3f} ms")
    print(
        {when: f"{x:+.1%}" for when, x in report["sums_overhead"].items()},
        f"prefill {report['prefill_seconds_median'] * 1e3:.1f} ms, sums {report['sums_share_of_prefill']:.2%} of it",
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
