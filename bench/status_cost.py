"""Cost of GET /v1/status and GET /metrics with 4 workers and a full ring of recent traces.

A FakeBackend with 2 prefill + 2 decode workers behind the real router app on 127.0.0.1 (uvicorn),
300 requests sent first so the status ring (256 traces) and the histograms are full, then N
sequential GETs of each endpoint over one keep-alive connection. Reports p50/p99 of the HTTP
round trip and of the handler's own work (called in-process; wall and CPU time: on a shared,
loaded machine the wall-clock p99 mostly measures preemption, the CPU time does not). The load
average is recorded with the result. Target: p99 < 5 ms each.

    .venv/bin/python -m bench.status_cost [--n 500] [--out bench/results/status_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import httpx

from common.stats import percentile
from router.app import build_app
from router.tokenizer import Tokenizer
from testkit.backend import FakeBackend
from testkit.harness import serve_app
from workers.models.files import resolve_model_dir


def pct(values: list[float], q: float) -> float:
    """common.stats.percentile at fraction q, in ms."""
    return percentile(values, q * 100) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--warm-requests", type=int, default=300)
    ap.add_argument("--out", default="bench/results/status_cost.json")
    args = ap.parse_args()
    tok = Tokenizer.from_model_dir(resolve_model_dir(None, quiet=True))
    backend = FakeBackend(tok, num_prefill=2, num_decode=2)
    app = build_app(backend, tok, "SmolLM2-135M-Instruct", 8192)
    metrics = app.state.baton.metrics
    result = {"benchmark": "status_cost", "workers": 4, "machine": platform.machine(), "target_p99_ms": 5.0}
    with serve_app(app) as served, httpx.Client(base_url=served.base_url, timeout=30) as client:
        for i in range(args.warm_requests):
            r = client.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 16})
            r.raise_for_status()
        for path in ("/v1/status", "/metrics"):
            for _ in range(20):
                client.get(path)
            times = []
            for _ in range(args.n):
                t0 = time.perf_counter()
                r = client.get(path)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200
            result[path] = {"http_p50_ms": pct(times, 0.5), "http_p99_ms": pct(times, 0.99), "bytes": len(r.content)}
        result["recent_traces"] = len(metrics.recent)
    for name, fn in (("/v1/status", metrics.status), ("/metrics", metrics.render)):
        times, cpu = [], []
        for _ in range(args.n):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        result[name].update(
            handler_p50_ms=pct(times, 0.5),
            handler_p99_ms=pct(times, 0.99),
            handler_cpu_p50_ms=pct(cpu, 0.5),
            handler_cpu_p99_ms=pct(cpu, 0.99),
        )
    result["load_average_1m"] = os.getloadavg()[0]
    result["cpus"] = os.cpu_count()
    result["pass"] = all(result[p]["http_p99_ms"] < 5.0 for p in ("/v1/status", "/metrics"))
    result["pass_handler_cpu"] = all(result[p]["handler_cpu_p99_ms"] < 5.0 for p in ("/v1/status", "/metrics"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
