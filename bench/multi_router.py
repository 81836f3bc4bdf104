"""Several router processes (`baton serve --api-server-count N`): throughput and prefix-cache hits.

Two measurements, written together to bench/results/multi_router.json:

1. **Routing decisions per second with 1, 2 and 4 router processes**, no model: each process is
   the real router app (HTTP, tokenising, the kv-aware policy over 8 + 8 workers, the response)
   over the in-process `testkit.backend.FakeBackend`, all of them bound to one port with
   SO_REUSEPORT as `baton serve` binds them. Load: `--clients` processes, each keeping
   `--connections` keep-alive connections busy with one-token chat completions for `--seconds`;
   the kernel spreads the connections over the routers. Reported: completed requests per second,
   in all and per router (from the x-baton-router header).
2. **Prefix-cache hit rate of the multi-turn chat workload (bench/routing_prefix.py) with 2
   routers against 1**: one real deployment (CPU, 2 prefill + 1 decode workers, the default model);
   phase "1 router" sends every turn to one router; phase "2 routers" (a new system prompt) sends
   turn t of every conversation to router t % 2, each router with its own `WorkerPools`, lease
   and prefix index fed by its own KV-event queue on every worker. If KV events reached only the
   router that sent a turn, every other turn would miss its own conversation's cache.

    .venv/bin/python -m bench.multi_router [--seconds 8] [--skip-hit-rate]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from common.envs import ensure_private_ray_env

ensure_private_ray_env()

import httpx

from common.net import free_port
from testkit.harness import healthy, serve_app, wait_until

HEADER = "x-baton-router"
BODY = {
    "messages": [{"role": "user", "content": "Route me somewhere with a cached prefix, please."}],
    "max_tokens": 1,
    "temperature": 0,
}


# ---- 1. throughput of N router processes over the fake backend -----------------------------------
def serve_fake_router(port: int, router_id: str) -> None:
    """One router process: the real app over FakeBackend, on the shared port (SO_REUSEPORT)."""
    from router.app import bind_socket, build_app, serve
    from router.routing import KvAwarePolicy, RoutingConfig
    from router.tokenizer import Tokenizer
    from testkit.backend import FakeBackend
    from workers.models.files import resolve_model_dir

    tokenizer = Tokenizer.from_model_dir(resolve_model_dir(quiet=True))
    backend = FakeBackend(tokenizer, num_prefill=8, num_decode=8)
    policy = KvAwarePolicy(backend.prefix_index, backend.block_size, RoutingConfig(seed=0))
    app = build_app(backend, tokenizer, "fake", 4096, policy, router_id=router_id)
    serve(app, host="127.0.0.1", port=port, log_level="warning", sock=bind_socket("127.0.0.1", port, reuse_port=True))


async def _load(url: str, connections: int, seconds: float, warmup_s: float) -> tuple[Counter, int]:
    done: Counter = Counter()
    errors = 0
    async with httpx.AsyncClient(
        base_url=url,
        timeout=30,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    ) as client:
        start = time.monotonic()
        measure_from, until = start + warmup_s, start + warmup_s + seconds

        async def worker() -> None:
            nonlocal errors
            while (now := time.monotonic()) < until:
                try:
                    r = await client.post("/v1/chat/completions", json=BODY)
                except httpx.TransportError:  # a keep-alive connection the server closed as we sent
                    errors += now >= measure_from
                    continue
                if now >= measure_from:
                    if r.status_code == 200:
                        done[r.headers[HEADER]] += 1
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(connections)))
    return done, errors


def _client(url: str, connections: int, seconds: float, warmup_s: float, out) -> None:
    done, errors = asyncio.run(_load(url, connections, seconds, warmup_s))
    out.put((dict(done), errors))


def throughput(routers: int, clients: int, connections: int, seconds: float, warmup_s: float) -> dict:
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "bench.multi_router", "--serve-fake", str(port), f"router-{i}"])
        for i in range(routers)
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 120, "the fake routers")
        seen: set[str] = set()
        wait_until(
            lambda: (
                seen.add(httpx.get(url + "/health", headers={"connection": "close"}).headers[HEADER])
                or len(seen) == routers
            ),
            120,
            f"{routers} routers to listen",
            every_s=0.05,
        )
        out = mp.get_context("spawn").Queue()
        loaders = [
            mp.get_context("spawn").Process(target=_client, args=(url, connections, seconds, warmup_s, out))
            for _ in range(clients)
        ]
        for p in loaders:
            p.start()
        per_router: Counter = Counter()
        errors = 0
        for _ in loaders:
            done, errs = out.get(timeout=seconds + warmup_s + 120)
            per_router.update(done)
            errors += errs
        for p in loaders:
            p.join()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    total = sum(per_router.values())
    result = {
        "routers": routers,
        "requests_per_s": total / seconds,
        "requests": total,
        "errors": errors,
        "per_router_requests_per_s": {k: v / seconds for k, v in sorted(per_router.items())},
    }
    print(
        f"{routers} router processes: {result['requests_per_s']:.0f} requests/s "
        f"({', '.join(f'{k} {v:.0f}' for k, v in result['per_router_requests_per_s'].items())})",
        flush=True,
    )
    return result


# ---- 2. prefix-cache hit rate, 2 routers vs 1, on a real deployment -----------------------------
def hit_rates(conversations: int, turns: int, max_tokens: int, kv_cache_memory: str) -> dict:
    from bench.routing_prefix import FOLLOW_UPS, TOPICS, system_prompt
    from cluster.config import BatonConfig
    from cluster.launcher import build_app, deploy
    from common.protocol import RouterClaim
    from router.flow import FlowLimits
    from router.pools import WorkerPools
    from router.ray_backend import RayBackend

    # api_server_count 2: the two routers' admission shares (the deployment starts no router process).
    config = BatonConfig.from_options(
        prefill_workers=2, decode_workers=1, kv_cache_memory=kv_cache_memory, max_num_seqs=16, api_server_count=2
    )
    dep = deploy(config, actor_name_prefix="bench-multi-router")
    second = RayBackend(
        WorkerPools(dep.workers, router=RouterClaim("router-1", config.placement.router_lease_s)), FlowLimits()
    )
    try:
        apps = [build_app(dep, 0, "router-0"), build_app(_with_backend(dep, second), 1, "router-1")]

        def phase(tag: str, routers: int) -> dict:
            with serve_app(apps[0]) as a, serve_app(apps[1]) as b:
                urls = [a.base_url, b.base_url][:routers]
                system = system_prompt(tag)
                convs = [
                    [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Explain {TOPICS[c % len(TOPICS)]}."},
                    ]
                    for c in range(conversations)
                ]
                prompt = cached = 0
                for turn in range(turns):
                    for c, messages in enumerate(convs):
                        r = httpx.post(
                            urls[turn % len(urls)] + "/v1/chat/completions",
                            timeout=300,
                            json={"messages": messages, "max_tokens": max_tokens, "temperature": 0},
                        )
                        r.raise_for_status()
                        usage = r.json()["usage"]
                        prompt += usage["prompt_tokens"]
                        cached += usage["prompt_tokens_details"]["cached_tokens"]
                        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                        messages.append({"role": "user", "content": FOLLOW_UPS[(c + turn) % len(FOLLOW_UPS)]})
                out = {
                    "routers": routers,
                    "requests": conversations * turns,
                    "prompt_tokens": prompt,
                    "cached_tokens": cached,
                    "hit_rate": cached / prompt,
                }
                print(f"{routers} router(s): prefix-cache hit rate {out['hit_rate']:.1%}", flush=True)
                return out

        one = phase("one router", 1)
        two = phase("two routers", 2)
    finally:
        dep.shutdown()
    return {
        "workload": {
            "conversations": conversations,
            "turns": turns,
            "max_tokens": max_tokens,
            "prefill_workers": 2,
            "decode_workers": 1,
            "kv_cache_memory": kv_cache_memory,
        },
        "one_router": one,
        "two_routers": two,
        "ratio": two["hit_rate"] / one["hit_rate"],
    }


def _with_backend(dep, backend):
    import dataclasses

    return dataclasses.replace(dep, backend=backend, pools=None)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-fake":
        serve_fake_router(int(sys.argv[2]), sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routers", default="1,2,4")
    ap.add_argument("--clients", type=int, default=2, help="load generator processes")
    ap.add_argument("--connections", type=int, default=32, help="keep-alive connections per load generator")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--skip-hit-rate", action="store_true")
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kv-cache-memory", default="160MiB")
    ap.add_argument("--out", default="bench/results/multi_router.json")
    args = ap.parse_args()
    result: dict = {
        "benchmark": "multi_router",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m_before": os.getloadavg()[0],
        "python": platform.python_version(),
        "command": "python -m bench.multi_router " + " ".join(sys.argv[1:]),
        "load": {
            "clients": args.clients,
            "connections_per_client": args.connections,
            "seconds": args.seconds,
            "request": "chat completion, max_tokens 1, fake backend",
        },
    }
    runs = [
        throughput(int(n), args.clients, args.connections, args.seconds, args.warmup) for n in args.routers.split(",")
    ]
    base = runs[0]["requests_per_s"]
    for run in runs:
        run["speedup_vs_first"] = run["requests_per_s"] / base
    result["throughput"] = runs
    if not args.skip_hit_rate:
        result["prefix_hit_rate"] = hit_rates(args.conversations, args.turns, args.max_tokens, args.kv_cache_memory)
    result["load_average_1m_after"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "throughput"}, indent=2))


if __name__ == "__main__":
    main()
