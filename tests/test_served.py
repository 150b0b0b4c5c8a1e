"""The served path: a real Prefect server, a process worker, the deployments of prefect.yaml.

Starts everything once on 127.0.0.1 with a free port and a temporary PREFECT_HOME, runs
`prefect deployment run 'prep-then-train/demo'`, waits for COMPLETED, checks the outputs, that the UI answers
at `/` and that the started run carries the artifacts and the per-stage log lines; that a failed run says why
under `--watch`; that a second `serve start` reuses the running server and worker (or refuses another port);
and that `serve stop` stops everything, a running flow run included (the last test). The fixture checks that
no process started from the home remains. The services are started as `make serve` starts them (the CLI,
from an environment without the Prefect settings conftest sets), and what the runs logged is read back from
the server's API.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from latentmill.pipelines import serve

from tests.conftest import REPO_ROOT

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


def _user_env() -> dict[str, str]:
    """The environment of a user's shell: none of the Prefect settings conftest sets for this process. The
    worker asks for scheduled runs every second (Prefect's default: every 10 s), as a user may set it too: a
    run waits for its pickup, not the test for a poll."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "PREFECT_WORKER_QUERY_SECONDS": "1"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # started as `make serve` starts it (`latentmill serve start`, through the CLI's main), from a user's
    # environment: what the CLI sets for its own console must not reach the server, worker and flow runs
    home, port = tmp_path_factory.mktemp("served") / "prefect-home", _free_port()
    pids: dict[str, int] = {}
    try:
        started = subprocess.run([sys.executable, "-m", "latentmill.cli", "serve", "start", "--home", str(home),
                                  "--port", str(port)], cwd=REPO_ROOT, env=_user_env(), capture_output=True,
                                 text=True, timeout=400)
        assert started.returncode == 0, started.stdout + started.stderr
        pids = serve.running(home)
        assert set(pids) == {"server", "worker"}, started.stdout
        yield home, port, pids
    finally:
        serve.stop(home)
        assert serve.from_home(home) == []
        for pid in pids.values():
            with pytest.raises(psutil.NoSuchProcess):
                psutil.Process(pid).wait(timeout=10)
                psutil.Process(pid)


def _serve_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "latentmill.pipelines.serve", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def _deployment_run(home, port, name: str, overrides: list[str], *watch: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*serve._prefect(), "deployment", "run", name, "--params", json.dumps({"overrides": overrides}), *watch],
        cwd=REPO_ROOT, env=serve.server_env(home, port), capture_output=True, text=True, timeout=480,
    )


def _runs(port: int, deployment: str) -> list[dict]:
    deployment_id = _api(port, f"deployments/name/{deployment}")["id"]
    return _api(port, "flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}},
                                           "sort": "EXPECTED_START_TIME_ASC"})


def _logs(port: int, run_id: str, wanted: list, timeout: float = 60.0) -> list[dict]:
    """The run's log records on the server once each of ``wanted`` (a predicate on a record) matches one, or
    when ``timeout`` s have passed: the run's last log batch may land just after its final state."""
    deadline = time.monotonic() + timeout
    while True:
        logs = _api(port, "logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"})
        if all(any(w(log) for log in logs) for w in wanted) or time.monotonic() > deadline:
            return logs
        time.sleep(1)


def test_prep_then_train_deployment_completes(served, tiny_flux, tmp_path):
    home, port, _ = served
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"model.pretrained={tiny_flux}", "trainer.max_steps=3",
                 "trainer.save_every=3"]
    result = _deployment_run(home, port, "prep-then-train/demo", overrides, "--watch", "--watch-timeout", "400")
    log = result.stdout + result.stderr
    worker_log = (home / "worker.log").read_text(errors="replace")[-4000:]
    assert result.returncode == 0, log + worker_log
    assert "COMPLETED" in log.upper(), log + worker_log

    cache = json.loads((out / "prep" / "cache" / "manifest.json").read_text())
    assert cache["counts"] == {"in": 24, "out": 24, "quarantined": 0}  # truncated.jpg: quarantined at curate
    steps = [json.loads(line)["step"] for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (out / "export" / "model_index.json").is_file()
    assert list((out / "train").glob("**/checkpoints/step-000003"))  # train/ or its run folder

    # The UI answers at / (as a browser asks for it), and the run the user started carries the artifacts
    # and the story of its stages and training.
    request = urllib.request.Request(serve.ui_url(port) + "/", headers={"Accept": "text/html"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/html")
        page = resp.read().decode()
    assert "<title>Prefect Server</title>" in page and ('id="root"' in page or 'id="app"' in page)

    runs = _runs(port, "prep-then-train/demo")
    assert [run["state_type"] for run in runs] == ["COMPLETED"]
    run_id = runs[0]["id"]
    artifacts = {a["key"]: a for a in _api(port, "artifacts/filter",
                                           {"artifacts": {"flow_run_id": {"any_": [run_id]}}}) if a["key"]}
    assert {"prep-counts", "prep-buckets", "prep-quarantine", "train-metrics"} <= set(artifacts)
    counts = json.loads(artifacts["prep-counts"]["data"])
    assert [(r["stage"], r["in"], r["out"]) for r in counts][-1] == ("cache", 24, 24)  # truncated.jpg: at curate
    assert "128x128x1" in artifacts["prep-buckets"]["data"]
    metrics = json.loads(artifacts["train-metrics"]["data"])
    assert metrics[0]["steps"] == 3 and (Path(metrics[0]["export_dir"]) / "model_index.json").is_file()
    assert Path(metrics[0]["export_dir"]).is_relative_to(out)

    # one INFO line per stage and one for training, sent by the flow run to the server (the Logs tab)
    wanted = ["ingest: 28 in → 27 out, 1 quarantined", "caption: 27 in → 27 out, 0 quarantined",
              "curate: 27 in → 24 out, 3 quarantined", "bucket: 24 in → 24 out, 0 quarantined",
              "cache: 24 in → 24 out, 0 quarantined", "train: 3 steps, final loss"]  # truncated.jpg: at curate
    logs = _logs(port, run_id, [lambda log, w=w: log["message"].startswith(w) for w in wanted])
    for w in wanted:
        assert [log["level"] for log in logs if log["message"].startswith(w)] == [20], (w, logs)


@pytest.mark.heavy  # a second served run; make test: the served deployment above, the CLI's failures in test_cli_errors.py
def test_failed_run_says_why(served, tmp_path):
    """A deployment run that fails on a bad override shows the one-line reason under `--watch`, and its state
    message carries it (what the UI shows); before, the watch ended "finished in state 'Failed'." alone."""
    home, port, _ = served
    result = _deployment_run(home, port, "train/demo", [f"output_dir={tmp_path / 'run'}", "trainer.mode=ful"],
                             "--watch", "--watch-timeout", "300")
    reason = "trainer.mode: 'ful' is not one of 'full', 'lora'"
    log = result.stdout + result.stderr
    assert result.returncode == 1 and "Failed" in log, log
    assert reason in " ".join(log.split()), log  # rich wraps long lines
    [run] = _runs(port, "train/demo")
    assert run["state"]["type"] == "FAILED" and reason in run["state"]["message"], run["state"]
    # and the server holds the error's line (the Logs tab), naming the key
    logs = _logs(port, run["id"], [lambda log: log["level"] >= 40 and "ConfigError" in log["message"]])
    errors = [log["message"].splitlines()[0] for log in logs if log["level"] >= 40]
    assert any("ConfigError" in line and reason in line for line in errors), logs


@pytest.mark.heavy
def test_second_start_reuses_and_stop_stops_everything(served, tiny_flux, tmp_path):
    """`make serve` twice keeps one server and one worker (same PIDs) and says so; another port is refused;
    `make serve-stop` stops the worker, the server and a running flow run (its own process group)."""
    home, port, pids = served
    again = _serve_cli("start", "--home", str(home), "--port", str(port))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Already running" in again.stdout and f"server PID {pids['server']}" in again.stdout, again.stdout
    assert serve.running(home) == pids
    commands = [" ".join(p.cmdline()) for p in serve.from_home(home)]
    assert sum("server start" in c for c in commands) == 1 and sum("worker start" in c for c in commands) == 1

    other = _serve_cli("start", "--home", str(home), "--port", str(_free_port()))
    assert other.returncode == 1 and f"already runs a server (PID {pids['server']}) on port {port}" in other.stderr
    assert serve.running(home) == pids

    # a long flow run, stopped while it works
    overrides = [f"output_dir={tmp_path / 'long'}", f"model.pretrained={tiny_flux}", "trainer.max_steps=100000"]
    started = _deployment_run(home, port, "prep-then-train/demo", overrides)
    assert started.returncode == 0, started.stdout + started.stderr
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        flow_runs = [p for p in serve.from_home(home) if p.pid not in pids.values()
                     and "prefect" in " ".join(p.cmdline()) and os.getpgid(p.pid) not in pids.values()]
        if flow_runs and (tmp_path / "long" / "prep").exists():
            break
        time.sleep(1)
    else:
        pytest.fail("the flow run did not start: " + (home / "worker.log").read_text(errors="replace")[-3000:])
    stop = _serve_cli("stop", "--home", str(home))
    assert stop.returncode == 0, stop.stderr
    assert f"worker (PID {pids['worker']})" in stop.stdout and f"server (PID {pids['server']})" in stop.stdout
    assert all(f"PID {p.pid}" in stop.stdout for p in flow_runs), stop.stdout
    assert serve.from_home(home) == []
    gone, alive = psutil.wait_procs(flow_runs, timeout=1)
    assert not alive
