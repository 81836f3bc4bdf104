"""Start-up time of `baton serve`: from launching the command to /health answering 200.

Runs the real CLI in a subprocess on a free 127.0.0.1 port, polls /health, then stops it with
SIGTERM and checks it exits. The default model must already be converted (the one-time GGUF
conversion is reported separately when it happens first).

    python -m bench.startup [--runs 3] [--out bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from testkit.harness import baton_serve


def one_start(extra: list[str], timeout_s: float) -> dict:
    """Launch `baton serve` (testkit.harness.baton_serve), time it to /health 200, then to its exit after SIGTERM."""
    with baton_serve(extra, ready_timeout_s=timeout_s, stop_timeout_s=60) as server:
        healthy_after = server.healthy_after_s
        proc = server.process
        stop = time.monotonic()
    stopped_after = time.monotonic() - stop
    return {"healthy_after_s": healthy_after, "shutdown_s": stopped_after, "exit_code": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", default="bench/results/startup.json")
    parser.add_argument("extra", nargs="*", help="extra flags for baton serve (after --)")
    args = parser.parse_args()
    from workers.models.files import resolve_model_dir

    convert_started = time.monotonic()
    resolve_model_dir(quiet=True)  # converts the GGUF the first time, a no-op afterwards
    model_resolution_s = time.monotonic() - convert_started
    runs = [one_start(args.extra, args.timeout) for _ in range(args.runs)]
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": os.cpu_count()},
        "command": "baton serve " + " ".join(args.extra),
        "model_resolution_s": model_resolution_s,
        "runs": runs,
        "healthy_after_s_median": statistics.median(r["healthy_after_s"] for r in runs),
        "healthy_after_s_max": max(r["healthy_after_s"] for r in runs),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
