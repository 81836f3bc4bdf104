"""The README's headline numbers, from bench/results/*.json.

The README is not built by MkDocs. Its headline numbers sit between markers::

    <!-- num: NAME -->1.58x<!-- /num -->

and ``NUMBERS[NAME]()`` below computes each from its JSON:

    python -m docs.hooks.readme --check   # exit 1 when a number differs from its JSON
    python -m docs.hooks.readme --write   # rewrite them in place

``tests/unit/test_docs_numbers.py`` runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from docs.hooks.results import ROOT, load, pct, ratio
from docs.hooks.tables_compare import compare_ratio

NUMBERS: dict[str, Callable[[], str]] = {
    # workload 1, client defaults, Baton float32 over vLLM-CPU float32 (output tok/s)
    "compare_w1_fp32": lambda: ratio(compare_ratio("baton-fp32", "default", "w1", "output_throughput", None)),
    # the same beside the CPU hog (bench/cpu_hog.py)
    "compare_w1_fp32_busy": lambda: ratio(
        compare_ratio("baton-fp32", "busy: default", "w1", "output_throughput", None)
    ),
    # Baton engine at 32 sequences over transformers generate one at a time (float32)
    "engine_c32_ratio": lambda: ratio(load("engine_throughput")["results"]["baton_c32"]["ratio_vs_hf_sequential"], 1),
    # kv-aware routing's prefix-cache hit rate on the multi-turn chat
    "routing_hit_rate": lambda: pct(load("routing_prefix")["kv_aware"]["hit_rate"]),
}
NUM = re.compile(r"<!-- num: ([\w.-]+) -->(.*?)<!-- /num -->")


def readme_numbers(text: str) -> list[tuple[str, str, str]]:
    """(name, value in the text, value computed from the JSON) for every marker in `text`."""
    return [(m.group(1), m.group(2), NUMBERS[m.group(1)]()) for m in NUM.finditer(text)]


def write_readme_numbers(text: str) -> str:
    return NUM.sub(lambda m: f"<!-- num: {m.group(1)} -->{NUMBERS[m.group(1)]()}<!-- /num -->", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the numbers in README.md")
    ap.add_argument("--check", action="store_true", help="fail when a number is stale (default)")
    args = ap.parse_args(argv)
    path = ROOT / "README.md"
    text = path.read_text()
    if args.write:
        path.write_text(write_readme_numbers(text))
        return 0
    stale = [(n, have, want) for n, have, want in readme_numbers(text) if have != want]
    for name, have, want in stale:
        print(f"README.md: {name} is {have!r}, bench/results says {want!r}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
