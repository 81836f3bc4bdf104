"""A bounded background load for the busy-host condition: one process that keeps one core busy a
fixed fraction of the time, at normal priority, then stops by itself.

    python -m bench.cpu_hog --duty 0.5 --period-ms 20 --seconds 600

Every `period` it spins for `duty * period` and sleeps for the rest, so it takes its share of a
core in short slices, as a log shipper, a sidecar or a neighbour's job does, rather than one long
burst the scheduler could push aside. It runs at the priority it was started with (the normal
one unless the caller says otherwise) beside every server alike. On SIGTERM or SIGINT, or after
`--seconds`, it prints what it did as one JSON line (busy seconds, wall seconds, achieved duty)
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import asdict

from cluster.busy_host import run_hog


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duty", type=float, default=0.5, help="fraction of each period spent spinning")
    parser.add_argument("--period-ms", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop by itself after this long")
    args = parser.parse_args(argv)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        report = run_hog(args.duty, args.period_ms / 1000.0, args.seconds, stop=lambda: bool(stopping))
    except ValueError as exc:
        print(f"cpu_hog: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
