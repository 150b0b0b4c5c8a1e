"""What `make demo` and `make test` install: the demo the package alone, the tests the dev tools too."""

from __future__ import annotations

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
