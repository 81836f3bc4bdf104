"""MkDocs hook: the supported model families, generated from the model registry.

A page asks for the table with an HTML comment on a line of its own::

    <!-- models: table -->   workers.models.registry's families: architectures, TP, sliding windows, MoE

The README is not built by MkDocs; its list of family names sits between markers::

    <!-- models: list -->Llama, Mistral and Qwen2<!-- /models -->

    python -m docs.hooks.models --check   # exit 1 when the README's list is not the registry's
    python -m docs.hooks.models --write   # rewrite it in place

``tests/unit/test_docs_models.py`` runs the check. Like the other hooks this module imports nothing
of Baton: a child process (``python -m docs.hooks.models --json``) prints the registry as JSON.
docs/hooks/__init__.py says why the sys.path line below is there.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # MkDocs loads this file by its path; the child imports Baton from ROOT
    sys.path.insert(0, str(ROOT))

from docs.hooks.markers import marker, render_markers  # noqa: E402 (after the path line above)

PLACEHOLDER = marker("models")
README_LIST = re.compile(r"<!-- models: list -->(.*?)<!-- /models -->")


def dump() -> list[dict[str, Any]]:
    """The registered families as JSON-able rows (runs in the child: imports the registry, torch-free)."""
    from workers.models.registry import families

    return [
        {
            "name": f.name,
            "architectures": list(f.architectures),
            "module": f.model_class.partition(":")[0],
            "tensor_parallel": f.tensor_parallel,
            "sliding_windows": f.window_rule.label,
            "moe": f.moe,
            "notes": f.notes,
        }
        for f in families()
    ]


@cache
def families() -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [sys.executable, "-m", "docs.hooks.models", "--json"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return tuple(json.loads(out.stdout))


def names_list(rows: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> str:
    """The family names in registry order, as a sentence says them: "Llama, Mistral and Qwen2"."""
    names = [r["name"] for r in rows]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def table(rows: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> str:
    head = [
        "| Family | `architectures` | Tensor parallel | Sliding windows without `layer_types` | MoE | "
        "What is specific to it |",
        "|---|---|---|---|---|---|",
    ]
    body = [
        f"| {r['name']} | {', '.join(f'`{a}`' for a in r['architectures'])} | "
        f"{'yes' if r['tensor_parallel'] else 'no'} | {r['sliding_windows']} | {'yes' if r['moe'] else 'no'} | "
        f"{r['notes'] or ''} |"
        for r in rows
    ]
    return "\n".join(head + body)


def build(name: str) -> str:
    if name == "table":
        return table(families())
    if name == "list":
        return names_list(families())
    raise KeyError(f"no models content named {name!r} (known: list, table)")


def render(markdown: str, where: str = "") -> str:
    return render_markers(PLACEHOLDER, build, markdown, where)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render(markdown, page.file.src_path)


def readme_lists(text: str) -> list[tuple[str, str]]:
    """(the list in the text, the registry's) for every README marker."""
    want = names_list(families())
    return [(m.group(1), want) for m in README_LIST.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the registry's families as JSON (the hook's child)")
    ap.add_argument("--write", action="store_true", help="rewrite the family list in README.md")
    ap.add_argument("--check", action="store_true", help="fail when README.md's list is stale (default)")
    args = ap.parse_args(argv)
    if args.json:
        print(json.dumps(dump()))
        return 0
    path = ROOT / "README.md"
    text = path.read_text()
    if args.write:
        path.write_text(README_LIST.sub(f"<!-- models: list -->{names_list(families())}<!-- /models -->", text))
        return 0
    stale = [(have, want) for have, want in readme_lists(text) if have != want]
    for have, want in stale:
        print(f"README.md lists {have!r}; the registry has {want!r}", file=sys.stderr)
    return 1 if stale or not readme_lists(text) else 0


if __name__ == "__main__":
    sys.exit(main())
