"""The configuration reference of docs/configuration.md (``<!-- config: reference -->``), from
`baton config schema`: one table for the top-level keys, then one per section.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from typing import Any

from docs.hooks.results import ROOT, table


@cache
def config_schema() -> dict[str, Any]:
    """`baton config schema`, run in a child process so the build imports nothing of Baton."""
    code = "import json; from cluster.config import json_schema; print(json.dumps(json_schema()))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True, timeout=300
    )
    return json.loads(out.stdout)


def _type(p: dict[str, Any]) -> str:
    if "enum" in p:
        return " \\| ".join(f"`{v}`" for v in p["enum"])
    t = p.get("type", "object" if "properties" in p else "")
    t = " \\| ".join(t) if isinstance(t, list) else t
    if t == "array" and isinstance(p.get("items"), dict):
        t = f"array of {_type(p['items'])}"
    return t


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(p: dict[str, Any]) -> str:
    if "default" not in p:
        return ""
    return "`" + json.dumps(p["default"]).replace("|", "\\|") + "`"


def config_reference(schema: dict[str, Any] | None = None) -> str:
    schema = schema or config_schema()
    top, sections = [], []
    for key, p in schema["properties"].items():
        if p.get("type") == "object" and "properties" in p:
            sections.append((key, p))
        else:
            top.append([f"`{key}`", _type(p), _default(p), _cell(p.get("description", ""))])
    out = ["## Top level", "", table(["key", "type", "default", "meaning"], top, "llll")]
    for key, p in sections:
        rows = [[f"`{k}`", _type(v), _default(v), _cell(v.get("description", ""))] for k, v in p["properties"].items()]
        out += [
            "",
            f"## `{key}`",
            "",
            _cell(p.get("description", "")),
            "",
            table(["key", "type", "default", "meaning"], rows, "llll"),
        ]
    return "\n".join(out)
