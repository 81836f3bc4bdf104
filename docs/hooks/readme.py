"""Check or rewrite the README's headline numbers from bench/results/*.json.

    python -m docs.hooks.readme --check   # exit 1 when a number differs from its JSON
    python -m docs.hooks.readme --write   # rewrite them in place

The numbers and how each is computed are `NUMBERS` in docs/hooks/tables.py.
"""

from __future__ import annotations

import argparse
import sys

from docs.hooks.tables import ROOT, readme_numbers, write_readme_numbers


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
