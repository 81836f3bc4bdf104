"""Module boundaries: project modules import each other at the top, packages depend one way
only (the layering below), no product module imports the test scaffolding (testkit), the tests or
the benchmarks, no module reads another object's underscore attributes, files stay small, and a
few names mean one thing (one `Role`, never a bare `role: str`).

A function-level import of a project module is how code works around a type living in the
wrong module or an import cycle; the few that remain must say why in a comment.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "router", "workers", "kvtransfer", "kernels", "cluster")
# Test scaffolding (fakes, harnesses, builders): it may import any product package; none imports it.
TESTKIT = "testkit"
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
    sample.write_text(
        "import os\nfrom workers import config\n\ndef f():\n    from router.routing import make_policy\n"
        "    import json\n    return make_policy\n"
    )
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


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_file_is_over_500_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


# -- package direction ------------------------------------------------------------------------
# What each package may import of the project (cluster: anything). common and kernels sit at the
# bottom; the router speaks to the workers only through common's wire vocabulary.
ALLOWED = {
    "common": set(),
    "kernels": {"common"},
    "kvtransfer": {"common", "kernels"},
    "workers": {"common", "kernels", "kvtransfer"},
    "router": {"common"},
    "cluster": set(PACKAGES),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, names: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at the top, in functions or under TYPE_CHECKING;
    relative imports resolved. With `names`, `from m import x` also gives m.x (x may be a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(filter(None, [*anchor, base]))
            found += [(node.lineno, base)]
            if names:
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported project package -> the places ("file:line") that import it."""
    graph: dict[str, dict[str, list[str]]] = {pkg: {} for pkg in PACKAGES}
    for path in product_files():
        src = path.relative_to(REPO).parts[0]
        for lineno, module in imported_modules(path):
            dst = module.split(".")[0]
            if dst in PACKAGES and dst != src:
                graph[src].setdefault(dst, []).append(f"{path.relative_to(REPO)}:{lineno}")
    return graph


def test_the_import_graph_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "router"
    pkg.mkdir()
    (pkg / "m.py").write_text("from . import x\nfrom .y import z\n\ndef f():\n    import workers.engine\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert imported_modules(pkg / "m.py") == [(1, "router"), (2, "router.y"), (5, "workers.engine")]


def test_no_two_packages_import_each_other():
    graph = package_graph()
    both_ways = [
        f"{a} <-> {b}: {graph[a][b][:3]} / {graph[b][a][:3]}"
        for a in PACKAGES
        for b in graph[a]
        if a < b and a in graph[b]
    ]
    assert not both_ways, "\n".join(both_ways)


def test_packages_import_only_the_layers_below():
    wrong = [
        f"{src} -> {dst} ({', '.join(where[:5])})"
        for src, deps in package_graph().items()
        for dst, where in deps.items()
        if dst not in ALLOWED[src]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_product_module_imports_the_test_scaffolding_the_tests_or_the_benchmarks():
    not_product = {TESTKIT, "tests", "bench"}
    wrong = [
        f"{path.relative_to(REPO)}:{lineno}: {module}"
        for path in product_files()
        for lineno, module in imported_modules(path)
        if module.split(".")[0] in not_product
    ]
    assert not wrong, "\n".join(wrong)


def test_the_test_scaffolding_imports_product_code_only():
    wrong = [
        f"{path.relative_to(REPO)}:{lineno}: {module}"
        for path in product_files((TESTKIT,))
        for lineno, module in imported_modules(path)
        if module.split(".")[0] in {"tests", "bench"}
    ]
    assert not wrong, "\n".join(wrong)


def imports_in_a_fresh_interpreter(*modules: str) -> set[str]:
    code = f"import sys\nfor m in {list(modules)!r}: __import__(m)\nprint('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_the_configuration_tree_loads_without_http_or_the_simulator():
    loaded = imports_in_a_fresh_interpreter("cluster.config")
    assert not {"fastapi", "cluster.sim", "cluster.autoscaler", "router.app"} & loaded


def test_the_autoscalers_decisions_load_without_http_ray_or_torch():
    loaded = imports_in_a_fresh_interpreter("cluster.autoscaler")
    assert not {"fastapi", "starlette", "ray", "torch", "router.app", "cluster.sim"} & loaded


def test_no_router_module_imports_torch():
    modules = sorted(module_name(p) for p in (REPO / "router").rglob("*.py"))
    loaded = imports_in_a_fresh_interpreter(*modules)
    assert "torch" not in loaded
    assert not {m for m in loaded if m.split(".")[0] == "workers"}


def test_common_imports_nothing_of_the_project_and_not_torch():
    modules = sorted(module_name(p) for p in (REPO / "common").rglob("*.py"))
    loaded = imports_in_a_fresh_interpreter(*modules)
    assert "torch" not in loaded
    assert not {m for m in loaded if m.split(".")[0] in set(PACKAGES) - {"common"}}


# -- import cycles ---------------------------------------------------------------------------------
# Inside a package, modules import each other one way only. Every import counts, at the top, in a
# function or under TYPE_CHECKING: a lazy import hides a cycle, it does not remove it. The workers
# sub-packages are layered too: quantization <- models <- engine <- parallel, speculative <- build <-
# shell (the engine receives its speculator from workers.build rather than importing it).


def module_graph(package: str) -> dict[str, dict[str, str]]:
    """module of `package` -> module of `package` it imports -> where ("file:line"). An import of a
    name counts as one of the module that defines it; `from pkg import mod` as one of pkg and of mod."""
    modules = {module_name(p): p for p in product_files((package,))}
    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        graph[name] = {}
        for lineno, imported in imported_modules(path, names=True):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].setdefault(imported, f"{path.relative_to(REPO)}:{lineno}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]] | dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as [a, b, ..., a], or None: a depth-first search in sorted order (stable)."""
    on_path: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return on_path[on_path.index(nxt) :] + [nxt]
            if nxt not in done and (cycle := visit(nxt)) is not None:
                return cycle
        on_path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)) is not None:
            return cycle
    return None


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    return " -> ".join(cycle) + "\n" + "\n".join(f"  {a} -> {b} at {graph[a][b]}" for a, b in zip(cycle, cycle[1:]))


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"y"}}) == ["y", "z", "y"]
    # A cycle closed by a function-level import and one through `from pkg import module`.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""doc"""\n')
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    graph = module_graph("pkg")
    assert graph["pkg.a"] == {"pkg": "pkg/a.py:1", "pkg.b": "pkg/a.py:1"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert "pkg.c -> pkg.a at pkg/c.py:2" in describe_cycle(find_cycle(graph), graph)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_any_package(package):
    graph = module_graph(package)
    cycle = find_cycle(graph)
    assert cycle is None, describe_cycle(cycle, graph)


def workers_subpackage(module: str) -> str:
    """workers.engine.scheduler -> workers.engine; a module at the top (workers.config) is its own."""
    return ".".join(module.split(".")[:2])


def test_the_workers_subpackages_import_each_other_without_a_cycle():
    graph: dict[str, dict[str, str]] = {}
    for module, deps in module_graph("workers").items():
        src = workers_subpackage(module)
        for dep, where in deps.items():
            if workers_subpackage(dep) not in (src, "workers"):
                graph.setdefault(src, {}).setdefault(workers_subpackage(dep), where)
    cycle = find_cycle(graph)
    assert cycle is None, describe_cycle(cycle, graph)
    # The engine core is built with its speculator and rank group, never reaching up for them.
    above = {"workers.speculative", "workers.parallel", "workers.build", "workers.shell"}
    assert not above & set(graph.get("workers.engine", {})), graph["workers.engine"]


# -- underscore attributes ------------------------------------------------------------------------
# `x._name` is read only on self, cls, super(), a name the module itself defines at its top level,
# or a name annotated as the enclosing class (another instance of the same class: `peer: "Cls"`).
# These (module, attribute) pairs reach into a library on purpose:
ALLOWED_PRIVATE = {
    ("testkit.cluster", "_private"): "ray._private.ray_constants: whether Ray was imported in cluster mode, "
    "which Ray offers no public way to ask",
    ("kvtransfer._gloo_core", "_Options"): "torch.distributed.ProcessGroupGloo takes its timeout and devices only "
    "through its _Options",
    ("kvtransfer._gloo_core", "_timeout"): "ProcessGroupGloo._Options' timeout field (torch names it so)",
    ("kvtransfer._gloo_core", "_devices"): "ProcessGroupGloo._Options' devices field (torch names it so)",
    ("kvtransfer.nccl", "_timeout"): "ProcessGroupNCCL.Options' timeout field (torch names it so)",
    ("workers.quantization.packed_linear", "_reorder_linear_weight"): "oneDNN weight prepacking: torch exposes "
    "it only as this op (what torch.compile's CPU path uses)",
    ("workers.quantization.packed_linear", "_linear_pointwise"): "the oneDNN linear over a prepacked weight "
    "(same op family)",
    ("cluster.placement", "_private"): "ray._private.state: free resources per node and an actor's node without "
    "Ray's dashboard (which Baton does not start); Ray has no public call for it",
    ("cluster.placement", "_actor_id"): "an ActorHandle's id, the key of that actor table (no public accessor)",
}


def is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def module_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def same_class_names(tree: ast.Module) -> dict[int, set[str]]:
    """id(Attribute node) -> the names its enclosing function annotates as the enclosing class."""
    found: dict[int, set[str]] = {}
    for klass in ast.walk(tree):
        if not isinstance(klass, ast.ClassDef):
            continue
        word = re.compile(rf"\b{klass.name}\b")
        for func in ast.walk(klass):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = func.args.posonlyargs + func.args.args + func.args.kwonlyargs
            typed = [(a.arg, a.annotation) for a in args if a.annotation is not None]
            typed += [
                (n.target.id, n.annotation)
                for n in ast.walk(func)
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            ]
            names = {name for name, ann in typed if word.search(ast.unparse(ann))}
            for node in ast.walk(func):
                if isinstance(node, ast.Attribute):
                    found.setdefault(id(node), set()).update(names)
    return found


def private_reads(path: Path) -> list[tuple[int, str]]:
    """(line, "x._attr") of every underscore attribute read off something other than self, cls,
    super(), one of the module's own top-level names or a name annotated as the enclosing class."""
    tree = ast.parse(path.read_text())
    own = module_level_names(tree) | {"self", "cls"}
    same_class = same_class_names(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        value = node.value
        if isinstance(value, ast.Name) and (value.id in own or value.id in same_class.get(id(node), ())):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        found.append((node.lineno, f"{ast.unparse(value)}.{node.attr}"))
    return found


def test_the_private_attribute_check_finds_reads_of_other_objects(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import ray\n_CACHE = {}\nclass A:\n    _n = 1\n    def f(self, other, peer: 'A | None'):\n"
        "        return self._x, cls._y if 0 else A._n, _CACHE._d, super()._z, other._w, ray._private, "
        "self.engine._q, type(self).__name__, peer._p\n"
    )
    assert sorted(private_reads(sample)) == [(6, "other._w"), (6, "ray._private"), (6, "self.engine._q")]


def test_no_module_reads_another_objects_underscore_attributes():
    violations, used = [], set()
    for path in product_files((*PACKAGES, TESTKIT)):
        rel, module = str(path.relative_to(REPO)), module_name(path)
        for lineno, text in private_reads(path):
            key = (module, text.rpartition(".")[2])
            if key in ALLOWED_PRIVATE:
                used.add(key)
            else:
                violations.append(f"{rel}:{lineno}: {text}")
    assert not violations, "\n".join(violations)
    assert used == set(ALLOWED_PRIVATE), f"allowed but no longer read: {set(ALLOWED_PRIVATE) - used}"


# -- one meaning per name -----------------------------------------------------------------------------


def classes_named(name: str) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in product_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == name
    ]


def test_one_class_is_named_role():
    """A worker's role is common.roles.Role; other enums have names of their own (kvtransfer's
    TransferSide: which side of a transfer a handle is)."""
    found = classes_named("Role")
    assert [where.partition(":")[0] for where in found] == ["common/roles.py"], found


def str_roles(path: Path) -> list[tuple[int, str]]:
    """(line, annotation) of every parameter, dataclass field or annotated variable named `role`
    (or ending in `_role`) annotated with a bare `str` (`str | None` included) instead of Role."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            named = [(x.arg, x.annotation, x.lineno) for x in a.posonlyargs + a.args + a.kwonlyargs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            named = [(node.target.id, node.annotation, node.lineno)]
        else:
            continue
        for name, annotation, lineno in named:
            if annotation is None or not (name == "role" or name.endswith("_role")):
                continue
            names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
            text = ast.unparse(annotation)
            if "str" in names or text.strip("'\"").split(" | ")[0] == "str":
                found.append((lineno, f"{name}: {text}"))
    return sorted(found)


def test_the_role_checker_finds_str_annotations(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from dataclasses import dataclass\n@dataclass\nclass A:\n    role: str\n    name: str\n"
        "def f(role: 'str', other: str, peer_role: str | None = None, ok: Role = 1): ...\n"
        "def g(role: Role): ...\n"
    )
    assert str_roles(sample) == [(4, "role: str"), (6, "peer_role: str | None"), (6, "role: 'str'")]


def test_no_product_code_annotates_a_role_as_str():
    """A role is common.roles.Role (a str enum, so it still equals and serialises as its value);
    values read from YAML or JSON become one with Role(value) where they enter."""
    found = [f"{p.relative_to(REPO)}:{lineno}: {text}" for p in product_files() for lineno, text in str_roles(p)]
    assert not found, "\n".join(found)
