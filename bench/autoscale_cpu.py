"""The autoscaler for real on this machine's CPU: a load step against `baton serve --autoscale`.

One deployment (Ray on 127.0.0.1, 1 prefill + 1 decode worker to start, the autoscaler on with
pools of 1-2 workers each, decisions every 3 s over 15 s of traffic, 20 s cool-down, TTFT target
1.5 s), then Poisson traffic of 96-token-id prompts and 32 output tokens: 0.2 req/s for 30 s, 3 req/s
for 60 s, 0.2 req/s for 90 s. The pools' sizes are sampled every second; every request must succeed.

    .venv/bin/python -m bench.autoscale_cpu

Writes bench/results/autoscale_cpu.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from common.envs import ensure_private_ray_env

ensure_private_ray_env()
ROOT = Path(__file__).resolve().parents[1]

import httpx

from bench import loadgen as load
from cluster.config import BatonConfig
from testkit.cluster import serving
from testkit.harness import free_port

PHASES = ((30.0, 0.2), (60.0, 3.0), (90.0, 0.2))  # (seconds, requests/s)


async def traffic(base_url: str, samples: list, pools) -> list[dict]:
    rng = random.Random(0)
    args = load.parser().parse_args(["--token-ids", "--ignore-eos", "--output-len", "32"])
    args.endpoint = "/v1/completions"
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(i: int, sent: float) -> None:
            prompt = [rng.randrange(1000, 40000) for _ in range(96)]
            r = await load.one_request(client, args, prompt)
            rows.append({"i": i, "sent_s": sent, "ok": r.ok, "error": r.error, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s})

        start = time.perf_counter()
        tasks, t, i = [], 0.0, 0
        for seconds, rate in PHASES:
            end = t + seconds
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    t = end
                    break
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
                tasks.append(asyncio.create_task(one(i, t)))
                i += 1
        await asyncio.gather(*tasks)
    return rows


def main() -> None:
    config = BatonConfig.from_options(
        port=free_port(),
        prefill_workers=1,
        decode_workers=1,
        kv_cache_memory="256MiB",
        autoscale=True,
        autoscale_interval=3.0,
        autoscale_window=15.0,
        autoscale_cooldown=20.0,
        autoscale_slo_ttft=1.5,
        autoscale_slo_tpot=0.25,
        min_prefill_workers=1,
        max_prefill_workers=2,
        min_decode_workers=1,
        max_decode_workers=2,
        autoscale_down_after=4,
    )
    samples: list[dict] = []
    stop = threading.Event()
    started = time.time()
    with serving(config, actor_name_prefix="bench-autoscale") as server:
        pools = server.deployment.pools

        def sample() -> None:
            while not stop.is_set():
                view = pools.pools()
                samples.append(
                    {
                        "t": time.time() - started,
                        "prefill": view.prefill,
                        "decode": view.decode,
                        "serving": sum(1 for w in view.workers if w.alive and not w.draining),
                    }
                )
                time.sleep(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.time()
        rows = asyncio.run(traffic(server.base_url, samples, pools))
        time.sleep(40)  # the quiet tail: let the pools come back down
        stop.set()
        sampler.join(timeout=5)
        actions = (
            list(server.server.config.app.state.autoscaler.actions)
            if hasattr(server.server.config.app.state, "autoscaler")
            else []
        )
    failed = [r for r in rows if not r["ok"]]
    sizes = [(s["prefill"], s["decode"]) for s in samples]
    result = {
        "benchmark": "autoscale_cpu",
        "phases": PHASES,
        "requests": len(rows),
        "failed": len(failed),
        "errors": sorted({r["error"] for r in failed})[:5],
        "traffic_started_s": t0 - started,
        "max_pools": [max(p for p, _ in sizes), max(d for _, d in sizes)] if sizes else None,
        "final_pools": list(sizes[-1]) if sizes else None,
        "actions": actions,
        "samples": samples,
        "ttft_ms": load.percentiles([r["ttft_s"] for r in rows if r["ok"]]),
        "machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "command": " ".join(["python"] + sys.argv),
    }
    out = ROOT / "bench/results/autoscale_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
