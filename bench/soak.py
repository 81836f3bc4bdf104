"""Soak test: steady load at about 80% of sustainable throughput, with careless clients, for a long time.

    python -m bench.soak --base-url http://127.0.0.1:8000 --duration 600 --out bench/results/soak.json

1. Calibration: closed-loop clients (--calibration-concurrency) for --calibrate seconds measure the
   sustainable request throughput X of the mix below (or give --rate to skip it).
2. Soak: Poisson arrivals at --load (0.8) x X for --duration seconds. Each request is one of:
   a normal completion (streamed or not; must answer 200 with a finish reason and, streamed,
   end with [DONE] and no error event), a client that disconnects mid-stream (--disconnect-share,
   10%), a client that gives up before the first token (--early-abort-share), or an oversized
   request that must be refused with 400 and the error envelope (--oversized-share: a prompt over
   the model's context, or a body over --max-request-body bytes).
3. Checks afterwards: no leaked KV blocks in either pool (every worker in /v1/status idle with
   kv_usage 0: a referenced block would show), nothing left in the router's admission gates,
   resident memory of the router and of every worker grown less than --max-rss-growth (5%) from
   the end of warm-up to the end of the load, /health 200 and a good request answered, and no
   error that was not intended. The JSON result says which check failed.

Traffic goes only to --base-url (keep it on 127.0.0.1); loops are bounded by time and stop by
themselves. Resident memory is read with psutil from the pids /v1/status reports, so the server
must run on this machine. `--serve "FLAGS"` starts `baton serve FLAGS` on a free 127.0.0.1 port for
the run (and stops it, with everything it started, afterwards) instead of using --base-url.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from common.stats import percentile
from testkit.harness import baton_serve

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue"
).split()


@dataclass
class Outcome:
    kind: str  # complete | disconnect | early_abort | oversized
    ok: bool  # the server did what this kind of request should get
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class Mix:
    disconnect: float = 0.10
    early_abort: float = 0.05
    oversized: float = 0.05
    stream: float = 0.8  # of the normal completions


def prompt_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 90)))


def ms_at(values: list[float], q: float) -> float | None:
    """common.stats.percentile(values, q) in ms, rounded (None when there are no values)."""
    return _ms(percentile(values, q)) if values else None


def envelope_ok(response: httpx.Response, status: int) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        response.status_code == status
        and set(error) == {"message", "type", "param", "code"}
        and error["code"] == status
    )


class Client:
    """The soak's requests, each checked against what the server must answer."""

    def __init__(self, http: httpx.AsyncClient, model: str, max_model_len: int, max_request_body: int) -> None:
        self.http = http
        self.model = model
        self.max_model_len = max_model_len
        self.max_request_body = max_request_body

    def body(self, rng: random.Random, stream: bool) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt_text(rng)}],
            "max_tokens": rng.randint(8, 48),
            "temperature": 0.7,
            "seed": rng.randrange(1 << 30),
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, rng: random.Random) -> Outcome:
        stream = rng.random() < Mix().stream
        started = time.perf_counter()
        if not stream:
            r = await self.http.post("/v1/chat/completions", json=self.body(rng, False))
            ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            return Outcome(
                "complete",
                ok,
                r.status_code,
                None,
                time.perf_counter() - started,
                r.json()["usage"]["completion_tokens"] if ok else 0,
                "" if ok else r.text[:200],
            )
        outcome = Outcome("complete", False)
        async with self.http.stream("POST", "/v1/chat/completions", json=self.body(rng, True)) as r:
            outcome.status = r.status_code
            if r.status_code != 200:
                outcome.error = (await r.aread())[:200].decode(errors="replace")
                return outcome
            finish, done = None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = json.dumps(chunk)[:200]
                    return outcome
                if outcome.ttft_s is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    outcome.ttft_s = time.perf_counter() - started
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    outcome.tokens = chunk["usage"]["completion_tokens"]
        outcome.e2e_s = time.perf_counter() - started
        outcome.ok = done and finish in ("stop", "length")
        outcome.error = "" if outcome.ok else f"stream ended without finish/[DONE] (finish={finish}, done={done})"
        return outcome

    async def disconnect(self, rng: random.Random) -> Outcome:
        """Read a few chunks of a long answer, then hang up."""
        body = dict(self.body(rng, True), max_tokens=64, ignore_eos=True)
        keep = rng.randint(1, 4)
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(
                    "disconnect", False, r.status_code, error=(await r.aread())[:200].decode(errors="replace")
                )
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen > keep:
                        break  # leaving the block closes the connection mid-stream
        return Outcome("disconnect", True, 200)

    async def early_abort(self, rng: random.Random) -> Outcome:
        """Give up before the first token: headers come with the first token, so before any response."""
        task = asyncio.ensure_future(self.complete_stream_headers(rng))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        if task.done():  # answered within the delay: nothing to abort
            failure = task.exception()
            return Outcome("early_abort", failure is None, error="" if failure is None else repr(failure)[:200])
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return Outcome("early_abort", True)

    async def complete_stream_headers(self, rng: random.Random) -> None:
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=dict(self.body(rng, True), max_tokens=32)
        ) as r:
            async for _ in r.aiter_lines():
                pass

    async def oversized(self, rng: random.Random) -> Outcome:
        if rng.random() < 0.5:  # a prompt over the context: token ids straight to /v1/completions
            body = {
                "model": self.model,
                "prompt": [rng.randrange(1000, 30000) for _ in range(self.max_model_len + 5)],
                "max_tokens": 4,
            }
            r = await self.http.post("/v1/completions", json=body)
        else:  # a body over the server's byte limit
            padding = "x" * (self.max_request_body + 1)
            r = await self.http.post(
                "/v1/chat/completions", json={"model": self.model, "messages": [{"role": "user", "content": padding}]}
            )
        ok = envelope_ok(r, 400)
        return Outcome("oversized", ok, r.status_code, error="" if ok else r.text[:200])

    async def run(self, kind: str, rng: random.Random) -> Outcome:
        try:
            return await getattr(self, kind)(rng)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return Outcome(kind, False, error=repr(exc)[:200])


def pick_kind(rng: random.Random, mix: Mix) -> str:
    x = rng.random()
    for kind, share in (("disconnect", mix.disconnect), ("early_abort", mix.early_abort), ("oversized", mix.oversized)):
        if x < share:
            return kind
        x -= share
    return "complete"


async def calibrate(client: Client, concurrency: int, seconds: float, seed: int) -> dict:
    """Closed loop: `concurrency` clients back to back; completed normal requests per second."""
    rng = random.Random(seed)
    stop_at = time.monotonic() + seconds
    outcomes: list[Outcome] = []

    async def loop() -> None:
        while time.monotonic() < stop_at:
            outcomes.append(await client.run("complete", random.Random(rng.random())))

    started = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    done = [o for o in outcomes if o.ok]
    return {
        "concurrency": concurrency,
        "seconds": elapsed,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "throughput_rps": len(done) / elapsed,
    }


class MemoryWatch:
    """Resident memory of the router and of every worker, by pid from /v1/status."""

    def __init__(self, status: dict) -> None:
        self.pids = {"router": status["router"]["pid"]}
        for workers in status["pools"].values():
            for w in workers:
                if w.get("pid"):
                    self.pids[w["worker_id"]] = w["pid"]

    def sample(self) -> dict[str, int]:
        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                out[name] = -1  # gone: a failed check below
        return out


async def wait_idle(http: httpx.AsyncClient, timeout_s: float) -> tuple[bool, dict]:
    """Every worker idle with no referenced KV block, and the admission gates empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = (await http.get("/v1/status")).json()
        workers = [w for pool in status["pools"].values() for w in pool]
        gates = status.get("admission") or {}
        idle = all(
            w["alive"] and w["running"] == 0 and w["waiting"] == 0 and w["kv_usage"] == 0.0 for w in workers
        ) and all(
            gates.get(p, {}).get("running", 0) == 0 and gates.get(p, {}).get("waiting", 0) == 0
            for p in ("decode", "prefill")
        )
        if idle or time.monotonic() > deadline:
            return idle, status
        await asyncio.sleep(0.5)


async def soak(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, headers=headers, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]
        client = Client(http, model["id"], model["max_model_len"], args.max_request_body)
        calibration = None
        rate = args.rate
        if rate is None:
            calibration = await calibrate(client, args.calibration_concurrency, args.calibrate, args.seed)
            rate = args.load * calibration["throughput_rps"]
        watch = MemoryWatch((await http.get("/v1/status")).json())
        mix = Mix(args.disconnect_share, args.early_abort_share, args.oversized_share)
        rng = random.Random(args.seed + 1)
        tasks: list[asyncio.Task] = []
        samples: list[tuple[float, dict]] = []
        warmup = min(args.warmup, args.duration / 2)
        started = time.monotonic()
        next_sample = started
        while (now := time.monotonic()) - started < args.duration:
            if now >= next_sample:
                samples.append((now - started, watch.sample()))
                next_sample += args.sample_every
            kind = pick_kind(rng, mix)
            tasks.append(asyncio.create_task(client.run(kind, random.Random(rng.random()))))
            await asyncio.sleep(min(rng.expovariate(rate), max(0.0, started + args.duration - time.monotonic())))
        end_of_load = watch.sample()
        outcomes: list[Outcome] = list(await asyncio.gather(*tasks))
        load_s = time.monotonic() - started
        idle, status = await wait_idle(http, args.idle_timeout)
        after_idle = watch.sample()
        health = (await http.get("/health")).status_code
        final = await client.run("complete", random.Random(args.seed + 2))

    baseline = next((s for t, s in samples if t >= warmup), samples[-1][1] if samples else end_of_load)
    growth = {
        name: (end_of_load[name] / baseline[name] - 1.0)
        if baseline.get(name, -1) > 0 and end_of_load[name] > 0
        else None
        for name in baseline
    }
    normal = [o for o in outcomes if o.kind == "complete" and o.ok]
    unintended = [o for o in outcomes if not o.ok]
    workers = [w for pool in status["pools"].values() for w in pool]
    checks = {
        "no_unintended_errors": not unintended,
        "no_leaked_kv_blocks": idle,
        "rss_growth_under_limit": all(g is not None and g < args.max_rss_growth for g in growth.values()),
        "healthy_after": health == 200 and final.ok,
    }
    return {
        "args": {k: v for k, v in vars(args).items() if k not in ("api_key", "out")},
        "calibration": calibration,
        "rate_rps": rate,
        "load_seconds": load_s,
        "requests": dict(Counter(o.kind for o in outcomes)),
        "completed": len(normal),
        "throughput_rps": len(normal) / load_s,
        "output_tokens_per_s": sum(o.tokens for o in normal) / load_s,
        "ttft_ms": {
            "p50": ms_at([o.ttft_s for o in normal if o.ttft_s is not None], 50),
            "p99": ms_at([o.ttft_s for o in normal if o.ttft_s is not None], 99),
        },
        "e2e_ms": {
            "p50": ms_at([o.e2e_s for o in normal if o.e2e_s], 50),
            "p99": ms_at([o.e2e_s for o in normal if o.e2e_s], 99),
            "mean": _ms(statistics.fmean([o.e2e_s for o in normal if o.e2e_s]) if normal else None),
        },
        "unintended_errors": len(unintended),
        "unintended_examples": [asdict(o) for o in unintended[:10]],
        "rss": {
            "warmup_s": warmup,
            "after_warmup": baseline,
            "end_of_load": end_of_load,
            "after_idle": after_idle,
            "growth": growth,
            "max_growth_allowed": args.max_rss_growth,
            "series": [{"t": round(t, 1), **s} for t, s in samples],
        },
        "workers_after": [
            {k: w[k] for k in ("worker_id", "role", "alive", "running", "waiting", "kv_usage")} for w in workers
        ],
        "admission_after": status.get("admission"),
        "checks": checks,
        "passed": all(checks.values()),
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
    }


@contextlib.contextmanager
def baton_server(flags: str, ready_timeout_s: float = 300.0, log_path: str | None = None):
    """`baton serve FLAGS` on a free 127.0.0.1 port, in its own process group (testkit.harness.baton_serve);
    yields the base URL. Its output goes to `log_path` (default: a new file in the temporary directory)."""
    with baton_serve(shlex.split(flags), ready_timeout_s=ready_timeout_s, log_path=log_path) as server:
        yield server.base_url


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--serve",
        default=None,
        metavar="FLAGS",
        help="start `baton serve FLAGS` on a free port for the run instead of using --base-url",
    )
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (never written to the result)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak load")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the memory baseline")
    p.add_argument("--calibrate", type=float, default=30.0, help="seconds of closed-loop calibration")
    p.add_argument("--calibration-concurrency", type=int, default=8)
    p.add_argument("--rate", type=float, default=None, help="requests per second (skips calibration)")
    p.add_argument("--load", type=float, default=0.8, help="share of the calibrated throughput to offer")
    p.add_argument("--disconnect-share", type=float, default=0.10)
    p.add_argument("--early-abort-share", type=float, default=0.05)
    p.add_argument("--oversized-share", type=float, default=0.05)
    p.add_argument("--max-request-body", type=int, default=8 << 20, help="the server's max_request_body in bytes")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds to wait for the pools to drain")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.serve is not None:
        with baton_server(args.serve) as url:
            args.base_url = url
            result = asyncio.run(soak(args))
    else:
        result = asyncio.run(soak(args))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    summary = {
        k: result[k]
        for k in ("rate_rps", "requests", "throughput_rps", "ttft_ms", "unintended_errors", "checks", "passed")
    }
    print(json.dumps(summary, indent=2))
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["passed"] else 1)
