"""Start-up time of `baton serve`: from launching the command to /health answering 200.

Runs the real CLI in a subprocess on a free 127.0.0.1 port, polls /health, then stops it with
SIGTERM and checks it exits. The default model must already be converted (the one-time GGUF
conversion is reported separately when it happens first).

    python bench/startup.py [--runs 3] [--out bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(extra: list[str], timeout_s: float) -> dict:
    port = free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    baton = Path(sys.executable).parent / "baton"
    started = time.monotonic()
    proc = subprocess.Popen([str(baton), "serve", "--port", str(port), *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    healthy_after = None
    try:
        while time.monotonic() - started < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"baton serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    healthy_after = time.monotonic() - started
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    finally:
        stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stopped_after = time.monotonic() - stop
    if healthy_after is None:
        raise RuntimeError(f"not healthy within {timeout_s} s")
    return {"healthy_after_s": healthy_after, "shutdown_s": stopped_after, "exit_code": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", default="bench/results/startup.json")
    parser.add_argument("extra", nargs="*", help="extra flags for baton serve (after --)")
    args = parser.parse_args()
    from workers.model_files import resolve_model_dir

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
