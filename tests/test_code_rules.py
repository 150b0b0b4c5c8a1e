"""Code rules checked by parsing the sources: no private names imported across modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED_DIRS = ("latentmill", "stages", "trainer", "pipelines", "bench")
OWN_PACKAGES = ("latentmill", "bench")  # imports from these (or relative ones) must name public names only


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
