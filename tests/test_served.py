"""The served path: a real Prefect server, a process worker, the deployments of prefect.yaml.

Starts everything on 127.0.0.1 with a free port and a temporary PREFECT_HOME, runs
`prefect deployment run 'prep-then-train/demo'`, waits for COMPLETED, checks the outputs, that the UI answers
at `/` and that the started run carries the artifacts and the per-stage log lines, and stops the worker and
the server by PID.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

from pipelines import serve

pytestmark = [pytest.mark.slow, pytest.mark.served]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(port: int, path: str, body: dict | None = None):
    """GET (or POST ``body`` to) the served REST API and decode its JSON answer."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture()
def served(tmp_path, monkeypatch):
    # the flow runs' INFO lines (one per stage, training) reach the API; conftest sets WARNING for this process
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "INFO")
    home, port = tmp_path / "prefect-home", _free_port()
    pids = serve.start(home, port)
    try:
        yield home, port, pids
    finally:
        stopped = serve.stop(home)
        assert stopped == ["worker", "server"]
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_prep_then_train_deployment_completes(served, tiny_flux, tmp_path):
    home, port, _ = served
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"model.pretrained={tiny_flux}", "trainer.max_steps=3",
                 "trainer.save_every=3"]
    env = serve.server_env(home, port)
    result = subprocess.run(
        [*serve._prefect(), "deployment", "run", "prep-then-train/demo",
         "--params", json.dumps({"overrides": overrides}), "--watch", "--watch-timeout", "400"],
        cwd=serve.REPO_ROOT, env=env, capture_output=True, text=True, timeout=480,
    )
    log = result.stdout + result.stderr
    worker_log = (home / "worker.log").read_text(errors="replace")[-4000:]
    assert result.returncode == 0, log + worker_log
    assert "COMPLETED" in log.upper(), log + worker_log

    cache = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    assert cache["counts"] == {"in": 25, "out": 24, "quarantined": 1}
    steps = [json.loads(line)["step"] for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (out / "export" / "model_index.json").is_file()
    assert (out / "train" / "checkpoints" / "step-000003").is_dir()

    # The UI answers at / (as a browser asks for it), and the run the user started carries the artifacts
    # and the story of its stages and training.
    request = urllib.request.Request(serve.ui_url(port) + "/", headers={"Accept": "text/html"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/html")
        page = resp.read().decode()
    assert "<title>Prefect Server</title>" in page and ('id="root"' in page or 'id="app"' in page)

    deployment = _api(port, "deployments/name/prep-then-train/demo")
    runs = _api(port, "flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}})
    assert [run["state_type"] for run in runs] == ["COMPLETED"]
    run_id = runs[0]["id"]
    artifacts = {a["key"]: a for a in _api(port, "artifacts/filter",
                                           {"artifacts": {"flow_run_id": {"any_": [run_id]}}}) if a["key"]}
    assert {"prep-counts", "prep-buckets", "prep-quarantine", "train-metrics"} <= set(artifacts)
    counts = json.loads(artifacts["prep-counts"]["data"])
    assert [(r["stage"], r["in"], r["out"]) for r in counts][-1] == ("cache", 25, 24)
    assert "128x128x1" in artifacts["prep-buckets"]["data"]
    metrics = json.loads(artifacts["train-metrics"]["data"])
    assert metrics[0]["steps"] == 3 and metrics[0]["export_dir"] == str(out / "export")

    wanted = ("ingest: 26 in → 25 out", "cache: 25 in → 24 out, 1 quarantined", "train: 3 steps, final loss")
    deadline = time.monotonic() + 60  # the flow run's last log batch may land just after its final state
    while True:
        lines = [log["message"] for log in _api(port, "logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}})]
        if all(any(m.startswith(w) for m in lines) for w in wanted) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for w in wanted:
        assert any(m.startswith(w) for m in lines), (w, lines)
