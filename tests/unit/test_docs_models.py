"""The docs' model table and the README's family list are the model registry's (docs/hooks/models.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from workers.models.registry import families

ROOT = Path(__file__).resolve().parents[2]


def _models():
    spec = importlib.util.spec_from_file_location("baton_docs_models", ROOT / "docs" / "hooks" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


models = _models()


def test_the_table_has_one_row_per_registered_family_with_its_capabilities():
    rows = re.findall(r"^\| ([^|`]+) \| ([^|]+) \| (yes|no) \| [^|]+ \| (yes|no) \|", models.build("table"), re.M)
    want = [
        (
            f.name,
            ", ".join(f"`{a}`" for a in f.architectures),
            "yes" if f.tensor_parallel else "no",
            "yes" if f.moe else "no",
        )
        for f in families()
    ]
    assert rows == want


def test_the_readme_lists_the_registered_families():
    lists = models.readme_lists((ROOT / "README.md").read_text())
    assert lists, "README.md has no <!-- models: list --> marker"
    for have, want in lists:
        assert want == models.names_list([{"name": f.name} for f in families()])
        assert have == want, "run python -m docs.hooks.models --write"


def test_the_architecture_page_generates_its_table_and_lists_no_family_by_hand():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert models.PLACEHOLDER.findall(page) == ["table"]
    assert "| Gemma 2 |" not in page  # the rows come from the registry at build time


def test_an_unknown_name_fails_the_build():
    with pytest.raises(KeyError, match="architecture.md: .*no models content named .*tables"):
        models.render("<!-- models: tables -->\n", "architecture.md")
