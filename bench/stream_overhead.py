"""What token streaming adds on top of decoding: decode worker -> router -> HTTP client.

Runs one deployment (1 prefill + 1 decode worker on 127.0.0.1), streams C concurrent requests of
N tokens each, and reports:
- delivery delay: from the decode worker queueing an output to the router receiving it (the Ray
  long-poll hop), p50/p99;
- the client's inter-token latency vs the engine alone decoding the same batch in one process
  with the same thread count (the difference is the whole streaming path's per-token cost).

    python -m bench.stream_overhead --concurrency 8 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from cluster.config import BatonConfig
from common.envs import ensure_private_ray_env
from common.stats import percentile
from testkit.cluster import serving
from testkit.harness import free_port

ensure_private_ray_env()


def pct(values, p):
    """common.stats.percentile at fraction p, in ms (None when there are no values)."""
    return percentile(values, p * 100) * 1000 if values else None


async def stream_all(base_url: str, concurrency: int, tokens: int) -> list[list[float]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(i: int) -> list[float]:
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": f"Story number {i}: once upon a time",
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            stamps = []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.perf_counter())
            return [b - a for a, b in zip(stamps, stamps[1:])]

        return await asyncio.gather(*(one(i) for i in range(concurrency)))


def engine_alone_step_ms(concurrency: int, tokens: int, threads: int) -> float:
    import torch

    from common.sampling_params import SamplingParams
    from workers.build import load_engine
    from workers.config import EngineConfig

    torch.set_num_threads(threads)
    engine = load_engine(None, EngineConfig(kv_cache_memory=256 << 20, num_threads=threads))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(concurrency)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill step
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/results/stream_overhead.json")
    args = parser.parse_args()

    port = free_port()
    config = BatonConfig.from_options(port=port, kv_cache_memory="256MiB")
    with serving(config) as running:
        deployment = running.deployment
        asyncio.run(stream_all(running.base_url, 2, 8))  # warm-up
        deployment.backend.pools.stream_delays.clear()
        itls = [x for gaps in asyncio.run(stream_all(running.base_url, args.concurrency, args.tokens)) for x in gaps]
        delays = list(deployment.backend.pools.stream_delays)
    step_ms = engine_alone_step_ms(args.concurrency, args.tokens, config.worker_threads())
    itl_p50 = pct(itls, 0.5)
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": os.cpu_count()},
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "threads_per_worker": config.worker_threads(),
        "delivery_delay_ms": {"p50": pct(delays, 0.5), "p99": pct(delays, 0.99), "samples": len(delays)},
        "client_itl_ms": {"p50": itl_p50, "p99": pct(itls, 0.99)},
        "engine_alone_step_ms_p50": step_ms,
        "streaming_overhead_ms_per_token_p50": itl_p50 - step_ms,
        "streaming_overhead_fraction_of_itl": (itl_p50 - step_ms) / itl_p50,
        "command": f"python -m bench.stream_overhead --concurrency {args.concurrency} --tokens {args.tokens}",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
