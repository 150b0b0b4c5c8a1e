"""What `make demo` and `make test` install: the demo the package alone, the tests the dev tools too."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_no_dev_tools(tmp_path):
    def plan(target: str) -> str:
        return subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout

    demo, test = plan("demo"), plan("test")
    assert "pip install --quiet -e ." in demo and "[dev]" not in demo
    assert "latentmill demo" in demo
    assert 'pip install --quiet -e ".[dev]"' in test and "pytest" in test


def test_what_every_prep_writes_installs_with_the_package():
    """`make demo` installs the package alone, and every prep writes ``prep/scores.parquet`` and its plots:
    pyarrow and matplotlib are dependencies, not extras that a demo run silently goes without."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]}
    assert {"pyarrow", "matplotlib"} <= required
