"""The served path: a real Prefect server, a process worker, the deployments of prefect.yaml.

Starts everything on 127.0.0.1 with a free port and a temporary PREFECT_HOME, runs
`prefect deployment run 'prep-then-train/demo'`, waits for COMPLETED, checks the outputs, and stops the
worker and the server by PID.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from pipelines import serve

pytestmark = [pytest.mark.slow, pytest.mark.served]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def served(tmp_path):
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
