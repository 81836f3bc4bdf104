"""Overload: 4x the sustainable concurrency for 60 s against a router whose admission gates are
sized to what the pools sustain.

    python -m bench.overload --out bench/results/overload.json

1. Calibration (a server with the default gates, started for it): closed-loop streaming clients
   at concurrency 1, 2, 4, ... for --step seconds each; the sustainable concurrency C is the
   largest whose TTFT p99 stays within --slo-ttft-ms (beyond it the batch grows, throughput
   creeps up and every request waits longer). Give --sustainable-concurrency to skip this.
2. Overload (a second server, started with --max-running-requests C --max-waiting-requests C):
   4 x C closed-loop clients for --duration seconds. A refused client waits Retry-After (as the
   OpenAI SDKs do) and tries again. Reported: how fast 429s come back (p50/p99/max, must be under
   50 ms), admitted requests' TTFT (p50/p99/max: bounded by the queue), errors other than 429,
   every process alive and its resident memory, and /health afterwards. Also where a 429's time
   goes: the router's own event-loop lag during the load (baton:router_event_loop_lag_seconds
   from its /metrics) and this client's (a probe beside the clients): on a 2-core machine that
   also runs the workers and the clients, the latency a client measures is mostly its own. A
   light client in a process of its own (one small request every 0.1 s) measures 429s as a client
   that is not itself saturated sees them.
3. Recovery: from the moment the load stops, one probe request every 0.5 s; the recovery time is
   when probe latency is back within 1.5x (or +100 ms of) the idle latency measured before the
   load, and stays there.

Traffic goes only to the servers this script starts on 127.0.0.1 (or --base-url); everything is
bounded in time and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import soak
from common.stats import percentile


@dataclass
class Sample:
    status: int
    latency_s: float  # to the first token (200) or to the answer (anything else)
    e2e_s: float = 0.0
    error: str = ""


async def one(http: httpx.AsyncClient, model: str, rng: random.Random, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": soak.prompt_text(rng)}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": rng.randrange(1 << 30),
        "stream": True,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return Sample(r.status_code, time.perf_counter() - started, error=text[:200])
            first = None
            async for line in r.aiter_lines():
                if (
                    line.startswith("data: {")
                    and first is None
                    and '"content":"' in line
                    and '"content":""' not in line
                ):
                    first = time.perf_counter() - started
                if line.startswith('data: {"error"'):
                    return Sample(599, first or 0.0, error=line[:200])
            return Sample(
                200, first if first is not None else time.perf_counter() - started, time.perf_counter() - started
            )
    except httpx.HTTPError as exc:
        return Sample(0, time.perf_counter() - started, error=repr(exc)[:200])


async def closed_loop(
    http, model, clients: int, seconds: float, max_tokens: int, seed: int, honour_retry_after: bool = True
) -> tuple[list[Sample], float]:
    stop_at = time.monotonic() + seconds
    samples: list[Sample] = []

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < stop_at:
            sample = await one(http, model, rng, max_tokens)
            samples.append(sample)
            if sample.status in (429, 503) and honour_retry_after:
                await asyncio.sleep(min(1.0, max(0.0, stop_at - time.monotonic())))

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return samples, time.monotonic() - started


async def loop_lag(samples: list[float], every_s: float = 0.05) -> None:
    """This client's own event-loop lag, sampled until cancelled: what of a measured latency is
    the load generator's, not the server's."""
    while True:
        started = time.perf_counter()
        await asyncio.sleep(every_s)
        samples.append(max(0.0, time.perf_counter() - started - every_s))


def light_probe(base_url: str, model: str, seconds: float, every_s: float, out) -> None:
    """A separate process sending one small request every `every_s` seconds (its own connection,
    its loop otherwise idle): the 429 latency a client sees that is not itself saturated. Puts
    (status, seconds) pairs on `out`."""

    async def run() -> list[tuple[int, float]]:
        results = []
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            stop_at = time.monotonic() + seconds
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                status = (await http.post("/v1/chat/completions", json=body)).status_code
                results.append((status, time.perf_counter() - started))
                await asyncio.sleep(every_s)
        return results

    out.put(asyncio.run(run()))


def lag_buckets(metrics_text: str) -> dict[float, float]:
    """The router's event-loop lag histogram: cumulative count per upper bound."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "baton:router_event_loop_lag_seconds":
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    out[float(s.labels["le"])] = s.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile q of the observations between two scrapes."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0.0
    return next((le for le, n in counts if n >= q * total), None) if total else None


def pct(values: list[float]) -> dict:
    return {
        "p50": soak.ms_at(values, 50),
        "p99": soak.ms_at(values, 99),
        "max": soak._ms(max(values) if values else None),
        "count": len(values),
    }


async def idle_latency(http, model, n: int, max_tokens: int) -> list[float]:
    rng = random.Random(7)
    return [(await one(http, model, rng, max_tokens)).latency_s for _ in range(n)]


async def calibrate(base_url: str, step_s: float, max_tokens: int, limit: int, slo_ttft_ms: float) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        steps = []
        concurrency = 1
        while concurrency <= limit:
            samples, elapsed = await closed_loop(http, model, concurrency, step_s, max_tokens, seed=concurrency)
            ok = [s for s in samples if s.status == 200]
            steps.append(
                {
                    "concurrency": concurrency,
                    "throughput_rps": len(ok) / elapsed,
                    "ttft_ms": pct([s.latency_s for s in ok]),
                    "e2e_ms": pct([s.e2e_s for s in ok]),
                }
            )
            concurrency *= 2
    within = [s["concurrency"] for s in steps if s["ttft_ms"]["p99"] is not None and s["ttft_ms"]["p99"] <= slo_ttft_ms]
    return {"steps": steps, "slo_ttft_ms": slo_ttft_ms, "sustainable_concurrency": max(within, default=1)}


def processes(status: dict) -> dict[str, dict]:
    out = {}
    pids = {"router": status["router"]["pid"]} | {
        w["worker_id"]: w["pid"] for pool in status["pools"].values() for w in pool if w.get("pid")
    }
    for name, pid in pids.items():
        try:
            out[name] = {"alive": True, "rss_mb": round(psutil.Process(pid).memory_info().rss / 2**20, 1)}
        except psutil.Error:
            out[name] = {"alive": False, "rss_mb": None}
    return out


async def overload(base_url: str, args, sustainable: int) -> dict:
    clients = args.factor * sustainable
    async with httpx.AsyncClient(
        base_url=base_url, timeout=300, limits=httpx.Limits(max_connections=clients + 16)
    ) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        baseline = await idle_latency(http, model, 5, args.max_tokens)
        before = processes((await http.get("/v1/status")).json())
        router_lag_before = lag_buckets((await http.get("/metrics")).text)
        client_lag: list[float] = []
        probe = asyncio.get_running_loop().create_task(loop_lag(client_lag))
        light_results: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
        # Starts once the load is on (1 s in) and stops before it ends.
        light = multiprocessing.get_context("spawn").Process(
            target=light_probe, args=(base_url, model, max(1.0, args.duration - 3.0), 0.1, light_results)
        )
        load = asyncio.ensure_future(closed_loop(http, model, clients, args.duration, args.max_tokens, seed=1))
        await asyncio.sleep(1.0)
        light.start()
        samples, elapsed = await load
        light_samples = await asyncio.to_thread(light_results.get, True, 120)
        light.join(30)
        probe.cancel()
        router_lag_after = lag_buckets((await http.get("/metrics")).text)
        stopped = time.monotonic()
        # Recovery: probes from the moment the load stops (requests still in flight drain meanwhile).
        probes = []
        while time.monotonic() - stopped < args.recovery_window:
            sample = await one(http, model, random.Random(len(probes)), args.max_tokens)
            probes.append(
                {
                    "t": round(time.monotonic() - stopped, 2),
                    "status": sample.status,
                    "latency_ms": round(sample.latency_s * 1000, 1),
                }
            )
            await asyncio.sleep(0.5)
        status = (await http.get("/v1/status")).json()
        after = processes(status)
        health = (await http.get("/health")).status_code
    normal = percentile(baseline, 50)
    limit = max(1.5 * normal, normal + 0.1)
    recovered_at = None
    for i, probe in enumerate(probes):
        if all(p["status"] == 200 and p["latency_ms"] / 1000 <= limit for p in probes[i:]):
            recovered_at = probe["t"]
            break
    admitted = [s for s in samples if s.status == 200]
    refused = [s for s in samples if s.status == 429]
    other = [s for s in samples if s.status not in (200, 429)]
    return {
        "clients": clients,
        "duration_s": elapsed,
        "requests": len(samples),
        "admitted": len(admitted),
        "refused_429": len(refused),
        "other_errors": len(other),
        "other_error_examples": [s.error for s in other[:5]],
        "admitted_throughput_rps": len(admitted) / elapsed,
        "latency_429_ms": pct([s.latency_s for s in refused]),
        # Where a refusal's time goes: the router's own event-loop lag during the load (its
        # /metrics histogram; p99 as the upper bound of its bucket, in ms), and this client's.
        "router_event_loop_lag_p99_ms_at_most": None
        if router_lag_after == {}
        else soak._ms(bucket_quantile(router_lag_before, router_lag_after, 0.99)),
        "client_event_loop_lag_ms": pct(client_lag),
        "light_client_429_ms": pct([t for status, t in light_samples if status == 429]),
        "light_client_statuses": {
            str(k): v for k, v in sorted(collections.Counter(s for s, _ in light_samples).items())
        },
        "admitted_ttft_ms": pct([s.latency_s for s in admitted]),
        "admitted_e2e_ms": pct([s.e2e_s for s in admitted]),
        "idle_ttft_ms": pct(baseline),
        "recovery": {
            "normal_ttft_ms": soak._ms(normal),
            "threshold_ms": soak._ms(limit),
            "recovered_after_s": recovered_at,
            "probes": probes,
        },
        "processes_before": before,
        "processes_after": after,
        "admission_after": status.get("admission"),
        "health_after": health,
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
        "checks": {
            "429_within_50ms_p99": bool(refused) and percentile([s.latency_s for s in refused], 99) < 0.05,
            "router_loop_lag_within_50ms_p99": (bucket_quantile(router_lag_before, router_lag_after, 0.99) or 1.0)
            <= 0.05,
            "light_client_429_within_50ms_p99": any(s == 429 for s, _ in light_samples)
            and percentile([t for s, t in light_samples if s == 429], 99) < 0.05,
            "no_other_errors": not other,
            "nothing_died": all(p["alive"] for p in after.values()) and health == 200,
            "recovered_within_10s": recovered_at is not None and recovered_at <= 10.0,
        },
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="an already running server (its gates as configured)")
    p.add_argument("--serve-flags", default="", help="extra `baton serve` flags for the servers this script starts")
    p.add_argument("--sustainable-concurrency", type=int, default=None, help="skip the calibration")
    p.add_argument("--step", type=float, default=15.0, help="seconds per calibration step")
    p.add_argument("--max-calibration-concurrency", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT p99 the sustainable concurrency keeps")
    p.add_argument("--factor", type=int, default=4, help="overload clients per sustainable client")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--recovery-window", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    log = None  # each server's output goes to a file in the temporary directory
    calibration = None
    sustainable = args.sustainable_concurrency
    if sustainable is None:
        with soak.baton_server(args.serve_flags, log_path=log) as url:
            calibration = asyncio.run(
                calibrate(url, args.step, args.max_tokens, args.max_calibration_concurrency, args.slo_ttft_ms)
            )
        sustainable = calibration["sustainable_concurrency"]
    gates = f"--max-running-requests {sustainable} --max-waiting-requests {sustainable}"
    if args.base_url:
        result = asyncio.run(overload(args.base_url, args, sustainable))
    else:
        with soak.baton_server(f"{args.serve_flags} {gates}", log_path=log) as url:
            result = asyncio.run(overload(url, args, sustainable))
    result = {
        "calibration": calibration,
        "sustainable_concurrency": sustainable,
        "server_flags": None if args.base_url else f"{args.serve_flags} {gates}".strip(),
        **result,
        "passed": all(result["checks"].values()),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "sustainable_concurrency",
                    "clients",
                    "admitted",
                    "refused_429",
                    "latency_429_ms",
                    "admitted_ttft_ms",
                    "recovery",
                    "checks",
                )
            },
            indent=2,
        )[:3000]
    )
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["passed"] else 1)
