"""MkDocs hook: measured tables and the configuration reference, generated at build time.

A page asks for generated content with an HTML comment on a line of its own::

    <!-- table: compare -->        a table built from bench/results/*.json (TABLES below)
    <!-- config: reference -->     the configuration reference, from `baton config schema`

and the hook replaces the comment with Markdown before the page is rendered. A name that no
builder knows, or a JSON file that is missing, fails the build (``mkdocs build --strict``), so a
page cannot show a number that no result file backs; tests/unit/test_docs_tables.py fails on a
table of measured numbers typed into a page instead.

The builders are the functions ``t_NAME`` of the modules in `MODULES`, one per docs page or kind of
table: a new table is a ``t_NAME`` in its page's module (or a new ``tables_*.py`` added to
`MODULES`). docs/hooks/__init__.py says how this file finds them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# MkDocs loads this file by its path, not as docs.hooks.tables: the repository root goes on sys.path
# so that the modules beside it import as the package docs.hooks (docs/hooks/__init__.py).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from docs.hooks import (  # noqa: E402 - needs the sys.path line above
    tables_compare,
    tables_engine,
    tables_kv,
    tables_lora,
    tables_operations,
    tables_sim,
    tables_speculative,
    tables_structured,
    tables_tp,
)
from docs.hooks.config_reference import config_reference  # noqa: E402 - needs the sys.path line above
from docs.hooks.results import RESULTS, ROOT, load, table  # noqa: E402, F401 - as before the split, for other hooks

PLACEHOLDER = re.compile(r"^<!--[ \t]*(table|config):[ \t]*([\w.-]+)[ \t]*-->[ \t]*$", re.MULTILINE)

MODULES = (
    tables_compare,  # performance.md: vLLM comparison, engine throughput, GPU, serving, routing
    tables_engine,  # performance.md: step profiles, sampler, FP8, AMX
    tables_kv,  # performance.md: the KV handoff and its checksums
    tables_lora,  # lora.md
    tables_tp,  # tensor-parallel.md
    tables_operations,  # operations.md
    tables_sim,  # sim.md, scale.md
    tables_speculative,  # speculative-decoding.md
    tables_structured,  # structured-outputs.md
)


def _collect() -> dict[str, Callable[[], str]]:
    found: dict[str, Callable[[], str]] = {}
    for module in MODULES:
        for name, fn in module.TABLES.items():
            if name in found:
                raise ValueError(f"table {name!r} is built in two modules: {module.__name__} and another")
            found[name] = fn
    return found


TABLES: dict[str, Callable[[], str]] = _collect()


def render(markdown: str, where: str = "") -> str:
    """Replace every placeholder in `markdown`; an unknown name raises."""

    def sub(m: re.Match[str]) -> str:
        kind, name = m.group(1), m.group(2)
        if kind == "config":
            if name != "reference":
                raise KeyError(f"{where}: no configuration section named {name!r} (known: reference)")
            return "\n" + config_reference() + "\n"
        if name not in TABLES:
            raise KeyError(f"{where}: no table named {name!r} (known: {', '.join(sorted(TABLES))})")
        return "\n" + TABLES[name]() + "\n"

    return PLACEHOLDER.sub(sub, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render(markdown, page.file.src_path)
