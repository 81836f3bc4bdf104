"""Module boundaries: project modules import each other at the top, and files stay small.

A function-level import of a project module is how code works around a type living in the
wrong module or an import cycle; the few that remain must say why in a comment.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "workers", "kvtransfer", "kernels", "cluster")
MAX_FUNCTION_LEVEL_IMPORTS = 3
MAX_LINES = 500


def product_files(packages=PACKAGES) -> list[Path]:
    return sorted(p for pkg in packages for p in (REPO / pkg).rglob("*.py"))


def imports_project_module(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in PACKAGES for alias in node.names)
    return False


def function_level_project_imports(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if imports_project_module(node):
                found.append((node.lineno, lines[node.lineno - 1]))
    return sorted(set(found))


def test_the_checker_finds_a_function_level_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom workers import config\n\ndef f():\n    from router.routing import make_policy\n"
                      "    import json\n    return make_policy\n")
    assert function_level_project_imports(sample) == [(5, "    from router.routing import make_policy")]


def test_at_most_three_function_level_project_imports_each_saying_why():
    found = []
    for path in product_files():
        lines = path.read_text().splitlines()
        for lineno, line in function_level_project_imports(path):
            where = f"{path.relative_to(REPO)}:{lineno}"
            found.append(where)
            above = lines[lineno - 2].strip() if lineno >= 2 else ""
            assert "#" in line or above.startswith("#"), f"{where} imports lazily without a comment saying why"
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, found


@pytest.mark.parametrize("path", product_files(("router", "workers", "kvtransfer", "cluster")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_file_is_over_500_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
