"""The README's Python API snippet, run as a user's first run: a fresh process and a fresh Prefect home.

It printed Prefect's INFO lines (the temporary server, every run state) and tracebacks of Prefect's telemetry
service (``sqlite3.OperationalError: database is locked``); the command line printed neither (issue 30, item 13).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

# heavy: the snippet in a fresh process and Prefect home; make test runs it in-process (test_e2e.py)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

# After the snippet: what the test checks, read in the same process. The API's temporary server is the
# command line's (latentmill.prefect_env), still up until the process exits.
_REPORT = """
import json as _json, urllib.request as _request
from latentmill import prefect_env as _env
with _request.urlopen(_env._early.api_url + "/admin/settings", timeout=30) as _resp:
    _server = _json.loads(_resp.read())["server"]
print("REPORT " + _json.dumps({"summary": summary, "analytics_enabled": _server["analytics_enabled"]}))
"""


def test_the_readme_api_snippet_prints_no_prefect_noise(tiny_flux, tmp_path):
    readme = (REPO_ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(from latentmill.api import run\n.*?)```", readme, re.S).group(1)
    overrides = '["trainer.max_steps=50"]'
    assert overrides in snippet, snippet
    out = tmp_path / "out"
    # on this test's output folder and tiny models, 2 steps (as tests/test_e2e.py runs it in-process)
    snippet = snippet.replace(overrides, f'["trainer.max_steps=2", "output_dir={out}", "model.pretrained={tiny_flux}"]')
    # a user's shell: none of the Prefect settings conftest sets for the test process, a home never used
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    result = subprocess.run([sys.executable, "-c", snippet + _REPORT], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "database is locked" not in result.stderr, result.stderr
    assert not [line for line in result.stderr.splitlines() if "| INFO" in line or "temporary server" in line], \
        result.stderr

    [report] = [json.loads(line[len("REPORT "):]) for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    summary = report["summary"]
    assert summary["train"]["steps"] == 2 and summary["stages"]["cache"]["out"] == 24
    assert summary["train"]["export_dir"] == str(out / "export")
    assert (out / "export" / "model_index.json").is_file()
    # the snippet's own line: the final loss and the export folder
    printed = result.stdout.splitlines()[-2].split()
    assert printed == [str(summary["train"]["final_loss"]), str(out / "export")], result.stdout
    # the temporary server ran without the telemetry service whose writes hit the locked database
    assert report["analytics_enabled"] is False
