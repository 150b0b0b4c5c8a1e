"""A killed command-line run leaves no Prefect API server behind.

With no ``PREFECT_API_URL`` Prefect starts a temporary ``uvicorn prefect.server.api.server`` subprocess and
stops it at exit; a ``kill`` or ``kill -9`` skips that, and the server stayed alive under PID 1.
``latentmill.prefect_env`` starts it with a parent-death signal. Real processes: ``latentmill run`` in a
subprocess, killed once its server answers and its prep has started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.conftest import DEMO_CONFIG, DEMO_IMAGES, prefect_home

pytestmark = pytest.mark.slow

SERVER_MODULE = "prefect.server.api.server"


def _ephemeral_servers(proc: psutil.Process) -> list[psutil.Process]:
    try:
        children = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if SERVER_MODULE in " ".join(c.cmdline())]


def _healthy(server: psutil.Process) -> bool:
    cmdline = server.cmdline()
    port = cmdline[cmdline.index("--port") + 1]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.heavy, id="SIGTERM"),  # SIGKILL's
                                 pytest.param(signal.SIGKILL, id="SIGKILL")])  # watch covers it in make test
def test_killed_run_leaves_no_api_server(sig, tiny_flux, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "latentmill.cli", "run", str(DEMO_CONFIG), f"output_dir={out}",
           f"model.pretrained={tiny_flux}", f"ingest.source={DEMO_IMAGES}", "trainer.max_steps=100000"]
    # stderr to a file, not a pipe: a run's progress bars and crash report would fill an unread pipe's 64 KB,
    # and a child blocked on a full pipe never exits
    stderr = open(tmp_path / "stderr.log", "w")
    cli = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                           start_new_session=True)
    server = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and cli.poll() is None:
            found = _ephemeral_servers(psutil.Process(cli.pid))
            if found and _healthy(found[0]) and (out / "prep").exists():  # serving, and the run is at work
                server = found[0]
                break
            time.sleep(0.5)
        assert cli.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
        assert server is not None, "no temporary Prefect API server started under the CLI"
        cli.send_signal(sig)
        cli.wait(timeout=30)
        gone, alive = psutil.wait_procs([server], timeout=10)
        assert not alive, f"Prefect's API server (PID {server.pid}) outlived the run killed with {sig.name}"
    finally:  # stop what this test started, by PID, whatever happened
        for proc in ([server] if server is not None else []):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        stderr.close()


def test_commands_run_in_one_process_share_one_api_server(tiny_flux, tmp_path):
    """``latentmill.cli.main`` called twice in one process (tests, a notebook) reuses the temporary API server
    it launched first: a server per call (~200 MB each) piled up until the process ended. Two preps of four
    demo images: the number of servers does not depend on the data."""
    from tests.test_retention import IMAGES, _fill

    _fill(tmp_path / "images", IMAGES[:4])
    script = f"""
import psutil, sys
from latentmill.cli import main
for run in ("a", "b"):
    assert main(["prep", {str(DEMO_CONFIG)!r}, "output_dir={tmp_path}/" + run, "model.pretrained={tiny_flux}",
                 "ingest.source={tmp_path / 'images'}"]) == 0
servers = [c for c in psutil.Process().children(recursive=True) if "{SERVER_MODULE}" in " ".join(c.cmdline())]
print("SERVERS", len(servers))
"""
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SERVERS 1" in done.stdout, done.stdout[-2000:]
