"""What a migration costs a request: the extra time to its next token when its decode worker is lost.

Runs one deployment (1 prefill + 2 decode workers on 127.0.0.1, round-robin routing, the admin
endpoint on with a drain timeout of 0), streams C concurrent requests of T tokens (EOS ignored),
and once every stream has produced K tokens moves half of them off their decode worker, two ways:

- **drain** (planned, `POST /admin/scale {"decode": 1}`): the router moves the removed worker's
  streams at once; the cost is the move itself: resubmit, re-prefill of prompt + K tokens on the
  other worker (through its prefix cache), then its next decode step, shared with the streams it
  already ran;
- **crash** (`SIGKILL` of the worker's process): the same, plus the time Ray takes to fail the
  router's calls to the dead process (Ray restarts the process meanwhile).

Per moved stream it reports its longest gap between two tokens from the event on (the seam) and
that gap minus the stream's own median inter-token latency: the **extra time to the next token**.
The same for the streams that did not move (their worker now also re-prefills the moved ones),
and the router's own measure (loss noticed -> next token, so without Ray's detection time).
Prompt lengths vary: the re-prefill grows with prompt + tokens so far. The server runs in this
process, so client and router share one clock.

    python -m bench.migration_cost --concurrency 4 --tokens 96 --after 32 --prompt-lengths 32 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from pathlib import Path

import httpx

from cluster.config import BatonConfig
from common.envs import ensure_private_ray_env
from common.worker_client import WorkerClient
from testkit.cluster import serving
from testkit.harness import free_port, wait_until

ensure_private_ray_env()


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


class Round:
    """C streams; `stamps[rid]` are the client's perf_counter times of each token chunk."""

    def __init__(self) -> None:
        self.stamps: dict[str, list[float]] = {}

    async def stream(self, client: httpx.AsyncClient, prompt: list[int], tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            stamps = self.stamps.setdefault(response.headers["x-request-id"], [])
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    stamps.append(time.perf_counter())


async def one_round(
    base_url: str, prompts: list[list[int]], tokens: int, after: int, event
) -> tuple[Round, float, set]:
    """Run the streams; when each has `after` tokens, call event() (returns the request ids it moves)."""
    r = Round()
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as client:
        tasks = [asyncio.create_task(r.stream(client, p, tokens)) for p in prompts]
        while len(r.stamps) < len(prompts) or min(len(s) for s in r.stamps.values()) < after:
            await asyncio.sleep(0.002)
        at = time.perf_counter()
        moved = await event()
        await asyncio.gather(*tasks)
    return r, at, moved


def stalls(r: Round, at: float, which: set) -> list[dict]:
    """Per stream: its longest gap between tokens from the event on (the seam for a moved stream),
    and that gap minus the stream's median inter-token latency."""
    out = []
    for rid in which:
        stamps = r.stamps[rid]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        after = [i for i, b in enumerate(stamps[1:]) if b > at]
        worst = max(after, key=lambda i: gaps[i])
        itl = statistics.median(g for i, g in enumerate(gaps) if i != worst)
        out.append(
            {
                "gap_ms": ms(gaps[worst]),
                "median_itl_ms": ms(itl),
                "extra_ms": ms(gaps[worst] - itl),
                "event_to_token_after_gap_ms": ms(stamps[worst + 1] - at),
                "tokens_before_gap": worst + 1,
            }
        )
    return out


def summary(rows: list[dict]) -> dict:
    if not rows:
        return {"streams": 0}
    return {
        "streams": len(rows),
        "extra_time_to_next_token_ms_p50": round(statistics.median(r["extra_ms"] for r in rows), 1),
        "extra_time_to_next_token_ms_max": max(r["extra_ms"] for r in rows),
        "median_itl_ms_p50": round(statistics.median(r["median_itl_ms"] for r in rows), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--after", type=int, default=32, help="tokens each stream has when its worker is lost")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--out", default="bench/results/migration_cost.json")
    args = parser.parse_args()

    import ray

    port = free_port()
    config = BatonConfig.from_options(
        port=port,
        prefill_workers=1,
        decode_workers=2,
        kv_cache_memory="256MiB",
        routing_policy="round-robin",
        admin_endpoint=True,
        drain_timeout=0.0,
    )
    results = []
    with serving(config, actor_name_prefix="migcost") as running:
        deployment, backend, url = running.deployment, running.deployment.backend, running.base_url

        def whole():
            infos = backend.workers()
            return sum(1 for w in infos if w.role == "decode" and w.alive and not w.draining) == 2

        def decode_workers() -> list[tuple[str, object]]:
            return sorted((w.worker_id, w.handle) for w in deployment.workers if w.role == "decode")

        asyncio.run(one_round(url, [[1, 2, 3]] * 2, 8, 1, lambda: asyncio.sleep(0, result=set())))  # warm-up
        for length in args.prompt_lengths:
            prompts = [[(100 + 37 * i + 11 * k) % 30000 + 10 for i in range(length)] for k in range(args.concurrency)]
            for kind in ("drain", "crash"):
                wait_until(whole, 600, "two decode workers")
                victim, handle = decode_workers()[0]
                victim_pid = ray.get(WorkerClient(handle).stats(), timeout=60).pid

                # one_round awaits event within this iteration; the defaults bind its values explicitly.
                async def event(kind=kind, victim_pid=victim_pid, victim=victim):
                    where = {live.flow.request_id: live.flow.decode_worker for live in backend.pools.requests}
                    if kind == "crash":
                        os.kill(victim_pid, signal.SIGKILL)
                        lost = victim
                    else:  # scale the decode pool to 1: the pool manager drains one at once (drain timeout 0)
                        async with httpx.AsyncClient(timeout=900) as admin:
                            answer = await admin.post(url + "/admin/scale", json={"decode": 1})
                            answer.raise_for_status()
                            (lost,) = answer.json()["removed"]
                    return {rid for rid, wid in where.items() if wid == lost}

                backend.migration_gaps.clear()
                r, at, moved = asyncio.run(one_round(url, prompts, args.tokens, args.after, event))
                moved_rows, other_rows = stalls(r, at, moved), stalls(r, at, set(r.stamps) - moved)
                router_gaps = [ms(g) for g in backend.migration_gaps]
                results.append(
                    {
                        "kind": kind,
                        "prompt_tokens": length,
                        "moved": summary(moved_rows),
                        "not_moved": summary(other_rows),
                        "router_loss_to_next_token_ms_p50": statistics.median(router_gaps) if router_gaps else None,
                        "moved_streams": moved_rows,
                        "other_streams": other_rows,
                    }
                )
                print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith("_streams")}), flush=True)
                if kind == "drain":
                    with httpx.Client(timeout=900) as admin:
                        admin.post(url + "/admin/scale", json={"decode": 2}).raise_for_status()
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)},
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "moved_after_tokens": args.after,
        "threads_per_worker": config.worker_threads(),
        "results": results,
        "command": f"python -m bench.migration_cost --concurrency {args.concurrency} --tokens {args.tokens} "
        f"--after {args.after} --prompt-lengths {' '.join(map(str, args.prompt_lengths))}",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
