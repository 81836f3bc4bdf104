"""The README's headline numbers and the docs' measured tables come from bench/results/*.json.

docs/hooks/tables.py builds the tables (the MkDocs hook, its builders in docs/hooks/tables_*.py) and
docs/hooks/readme.py the README's numbers (`python -m docs.hooks.readme`); these checks need neither
MkDocs nor a model. tests/unit/test_docs_tables.py refuses a measured table typed into a page.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tables():
    spec = importlib.util.spec_from_file_location("baton_docs_tables", ROOT / "docs" / "hooks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _tables()  # loaded by its path, as MkDocs loads it; it puts the repository on sys.path

from docs.hooks import readme  # noqa: E402 - importable once tables.py has run

README = (ROOT / "README.md").read_text()


def test_readme_has_three_headline_numbers():
    names = [name for name, _, _ in readme.readme_numbers(README)]
    assert sorted(names) == sorted(readme.NUMBERS), names


@pytest.mark.parametrize("name", sorted(readme.NUMBERS))
def test_readme_number_equals_its_json(name):
    found = {n: (have, want) for n, have, want in readme.readme_numbers(README)}
    have, want = found[name]
    assert have == want, f"README says {have}, bench/results says {want}: run python -m docs.hooks.readme --write"


def test_readme_is_short_and_its_doc_links_resolve():
    assert len(README.splitlines()) <= 250
    for target in re.findall(r"\]\((docs/[^)#\s]+)", README):
        assert (ROOT / target).is_file(), target


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_table_placeholder_builds(page):
    text = (ROOT / "docs" / page).read_text()
    for kind, name in tables.PLACEHOLDER.findall(text):
        if kind == "table":
            assert name in tables.TABLES, f"{page}: unknown table {name!r}"
            assert tables.TABLES[name]().startswith("| ")
    assert not re.search(r"\w_attempt_\w*\.json", text), f"{page} cites an experiment (*_attempt_*)"


def test_config_reference_renders_every_section():
    schema = {
        "properties": {
            "model": {"type": ["string", "null"], "default": None, "description": "m"},
            "engine": {
                "type": "object",
                "description": "the engine",
                "properties": {"dtype": {"enum": ["float32", "bfloat16"], "default": "float32", "description": "d"}},
            },
        }
    }
    out = tables.config_reference(schema)
    assert "## `engine`" in out and "`dtype`" in out and "`float32` \\| `bfloat16`" in out
