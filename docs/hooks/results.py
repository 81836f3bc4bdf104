"""What every table builder of docs/hooks/ shares: bench/results/*.json by name, number formatting,
and the Markdown table.

The builders live in one module per docs page (``tables_*.py``); docs/hooks/tables.py, the MkDocs
hook, collects their ``t_NAME`` functions with `builders` and puts each table where a page says
``<!-- table: NAME -->``. See docs/hooks/__init__.py for how the modules find one another.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


@cache
def load(name: str) -> Any:
    """One result file of bench/results/, by name without `.json`."""
    if "_attempt_" in name:
        raise ValueError(f"{name}: *_attempt_* files are experiments, not results")
    return json.loads((RESULTS / f"{name}.json").read_text())


# -- formatting ---------------------------------------------------------------------------------


def f(x: float, nd: int = 1) -> str:
    """A number with thousands separators and `nd` decimals."""
    return f"{x:,.{nd}f}"


def ms(x: float) -> str:
    """Milliseconds: no decimals from 100 on, one below."""
    return f(x, 0) if abs(x) >= 100 else f(x, 1)


def pct(x: float, nd: int = 1, sign: bool = False) -> str:
    return f"{x * 100:+.{nd}f}%" if sign else f"{x * 100:.{nd}f}%"


def ratio(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}x"


def gb(bytes_per_s: float, nd: int = 2) -> str:
    return f"{bytes_per_s / 1e9:.{nd}f}"


def size(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A Markdown table; `align` is one letter per column, l or r (default: l, then r)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def builders(namespace: dict[str, Any]) -> dict[str, Callable[[], str]]:
    """A builder module's tables: each function `t_NAME` of `namespace` as NAME."""
    return {name[2:]: fn for name, fn in namespace.items() if name.startswith("t_") and callable(fn)}
