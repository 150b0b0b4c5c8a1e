"""Code rules checked by parsing the sources: no private names imported across modules, no import cycles
(function-level imports count), a ground package (``latentmill.core``) that imports no other part of
latentmill, and tests that import the package only as ``latentmill.*``."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
CHECKED_DIRS = ("latentmill", "stages", "trainer", "pipelines", "bench")
OWN_PACKAGES = ("latentmill", "bench")  # imports from these (or relative ones) must name public names only
# The repository's folders as the package names they install under (pyproject.toml's package-dir).
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
ROOMS = ("stages", "trainer", "pipelines")  # folders that import as latentmill.<room>, never bare
CORE = "latentmill.core"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports() -> list[str]:
    """Return 'path:line: from module import name' for each private name imported across modules."""
    offenders = []
    for folder in CHECKED_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom):
                    continue
                module = node.module or ""
                if node.level == 0 and module.split(".")[0] not in OWN_PACKAGES:
                    continue
                for alias in node.names:
                    if _is_private(alias.name):
                        rel = path.relative_to(ROOT)
                        dots = "." * node.level
                        offenders.append(f"{rel}:{node.lineno}: from {dots}{module} import {alias.name}")
    return offenders


def test_no_private_names_imported_across_modules():
    assert private_imports() == []


def package_modules() -> dict[str, Path]:
    """Every module of the installed package (``latentmill.stages.curate``...) and its source file."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    """Every import statement that can run, at any depth (function bodies included): the bodies of
    ``if TYPE_CHECKING:`` never run, so they are left out."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        stack.extend(children)


def _with_parents(name: str, modules: dict[str, Path]) -> list[str]:
    """``name`` and the packages above it: importing a module runs each enclosing package's ``__init__``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules]


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """For each module (default: the package's), the modules among them it imports (module level or inside a
    function, relative imports resolved), each with the line of its first such import."""
    modules = package_modules() if modules is None else modules
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _runtime_imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                for module in _with_parents(target, modules):
                    if module != name:
                        graph[name][module] = min(graph[name].get(module, node.lineno), node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as its path of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        iters = [iter(sorted(graph[start]))]
        state[start] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    modules = package_modules()
    steps = [f"  {a} ({modules[a].relative_to(ROOT)}:{graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:])]
    return "import cycle:\n" + "\n".join(steps)


def test_find_cycle_reports_the_path():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"b": 3, "d": 4}, "d": {}}
    assert find_cycle(graph) == ["b", "c", "b"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"b": 2}}) is None


def test_import_graph_counts_function_level_relative_and_package_imports(tmp_path):
    sources = {
        "pkg/__init__.py": "from . import a\n",
        "pkg/a.py": "def f():\n    from .b import g\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n"
                    "def g():\n    import pkg.c\n",
        "pkg/c.py": "def h():\n    from pkg import a\n",
    }
    modules = {}
    for rel, text in sources.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
        name = rel[:-3].replace("/", ".").removesuffix(".__init__")
        modules[name] = tmp_path / rel
    graph = import_graph(modules)
    assert graph == {"pkg": {"pkg.a": 1}, "pkg.a": {"pkg": 2, "pkg.b": 2}, "pkg.b": {"pkg": 5, "pkg.c": 5},
                     "pkg.c": {"pkg": 2, "pkg.a": 2}}
    assert find_cycle(graph) == ["pkg", "pkg.a", "pkg"]  # importing pkg.a runs pkg/__init__, which imports it


def test_no_import_cycles():
    graph = import_graph()
    assert "latentmill.stages.curate" in graph and "latentmill.core.durable" in graph
    cycle = find_cycle(graph)
    assert cycle is None, describe_cycle(cycle, graph)


def test_core_imports_no_other_part_of_latentmill():
    graph = import_graph()
    offenders = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items()) if name == CORE or name.startswith(CORE + ".")
        for target in sorted(targets)
        if target != "latentmill" and not (target == CORE or target.startswith(CORE + "."))
    ]
    assert offenders == []


def bare_room_imports(folder: str) -> list[str]:
    """'path:line: module' for each import of a room by its folder name (``stages.x``) instead of ``latentmill.*``."""
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for module in names:
                if module.split(".")[0] in ROOMS:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}")
    return offenders


def test_tests_and_benchmarks_import_only_latentmill():
    assert bare_room_imports("tests") + bare_room_imports("bench") == []
