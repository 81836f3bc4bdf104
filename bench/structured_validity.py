"""Every structured reply valid, at full size: schema requests over HTTP against a real deployment
(Ray on 127.0.0.1, 1 prefill + 2 decode workers of the default model), then the same load with a
decode worker SIGKILLed mid-reply.

    python -m bench.structured_validity                      # 200 requests per run, concurrency 16
    python -m bench.structured_validity --num-prompts 40     # a quicker run

The requests (bench.structured_load.schema_load) spread over the five schemas, half streamed,
every third sampled at temperature 0.7 (seeded) and the rest greedy; every other one opens with a
long system message of its own, so the kv-aware router prefills it on the prefill worker and the
others on the decode worker. Each reply is checked with jsonschema and must end with `stop`. The
second run kills decode-0 once it is running 3 requests: its requests migrate (counted) and must
still validate. tests/structured/test_structured_serve.py replays the same load smaller.

JSON: bench/results/structured_validity.json (per run: requests, invalid replies with the reason,
remote and local prefills, migrations, seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

from common.envs import ensure_private_ray_env

ensure_private_ray_env()  # before Ray is imported (testkit.cluster)

from bench.structured_load import schema_load
from cluster.config import BatonConfig
from testkit.cluster import leave_ray, serving
from testkit.harness import free_port, wait_until

REPO = Path(__file__).resolve().parents[1]
LOCAL_THRESHOLD = 60  # as tests/structured: the long system messages' requests go the remote way


def _summary(name: str, replies, counters_before: dict, counters_after: dict, seconds: float) -> dict:
    invalid = [
        {"schema": r.request.schema_name, "problem": r.problem, "text": r.text[:200]}
        for r in replies
        if r.problem is not None
    ]
    delta = {
        k: counters_after.get(k, 0) - counters_before.get(k, 0)
        for k in ("remote_prefill", "local_prefill", "migrations")
    }
    return {
        "run": name,
        "requests": len(replies),
        "valid": len(replies) - len(invalid),
        "invalid": invalid,
        "by_schema": dict(Counter(r.request.schema_name for r in replies)),
        **delta,
        "seconds": round(seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structured_validity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "structured_validity.json"))
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.max_concurrency < 1:
        parser.error("--num-prompts and --max-concurrency must be at least 1")

    config = BatonConfig.from_options(
        port=free_port(),
        prefill_workers=1,
        decode_workers=2,
        kv_cache_memory="64MiB",
        max_num_seqs=32,
        local_prefill_threshold=LOCAL_THRESHOLD,
        request_timeout=600.0,
        max_restarts=2,
    )
    leave_ray()
    runs = []
    with serving(config, actor_name_prefix="structured-bench") as running:
        backend = running.deployment.backend
        url = running.base_url

        def load(during=None):
            return asyncio.run(schema_load(url, args.num_prompts, args.max_concurrency, args.max_tokens, 600.0, during))

        before, started = dict(backend.counters), time.monotonic()
        replies = load()
        runs.append(_summary("clean", replies, before, dict(backend.counters), time.monotonic() - started))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "invalid"}), flush=True)

        before, started = dict(backend.counters), time.monotonic()
        replies = load(running.killer_mid_reply("decode-0"))
        runs.append(
            _summary("decode-0 killed mid-reply", replies, before, dict(backend.counters), time.monotonic() - started)
        )
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "invalid"}), flush=True)
        wait_until(lambda: all(w.alive for w in backend.workers()), 180, "Ray to restart decode-0")

    result = {
        "benchmark": "structured_validity",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m bench.structured_validity " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_1_5_15": list(os.getloadavg()),
        },
        "deployment": {"prefill_workers": 1, "decode_workers": 2, "local_prefill_threshold": LOCAL_THRESHOLD},
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(not r["invalid"] for r in runs) and runs[1]["migrations"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
