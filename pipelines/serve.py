"""Start and stop a local Prefect server, a process work pool and worker, and the deployments.

    python -m pipelines.serve start [--port 4200] [--home .prefect]    (what `make serve` runs)
    python -m pipelines.serve stop  [--home .prefect]                  (what `make serve-stop` runs)

Everything listens on 127.0.0.1 and keeps its state (SQLite, logs, PIDs) under ``--home``, which becomes
``PREFECT_HOME``. The server also serves the Prefect UI at ``http://127.0.0.1:PORT`` (the assets ship in the
installed ``prefect`` package): each run's Artifacts tab holds the prep counts, bucket histogram, quarantine
reasons and training metrics, its Logs tab one line per stage. The tests use the same functions with a
temporary home and a free port.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL = "latentmill-process"


def _prefect() -> list[str]:
    exe = shutil.which("prefect", path=str(Path(sys.executable).parent)) or shutil.which("prefect")
    return [exe] if exe else [sys.executable, "-m", "prefect"]


def ui_url(port: int) -> str:
    """Where the local server serves the Prefect UI."""
    return f"http://127.0.0.1:{port}"


def ui_assets() -> Path:
    """The UI's built assets in the installed ``prefect`` package, or an error that says how to get them."""
    import prefect

    index = Path(prefect.__ui_static_path__) / "index.html"
    if not index.is_file():
        raise FileNotFoundError(f"the Prefect UI assets are missing ({index}): the installed package has no UI "
                                "(prefect-client?); install the full `prefect` package into the venv")
    return index.parent


def server_env(home: Path, port: int) -> dict[str, str]:
    """Environment that points Prefect clients, server, worker and flow runs at this local server."""
    env = dict(os.environ)
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"{ui_url(port)}/api",
        "PREFECT_UI_URL": ui_url(port),  # the links Prefect prints and logs ("View at ...")
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "LATENTMILL_ROOT": str(REPO_ROOT),  # prefect.yaml's pull step runs flows from here
    })
    import prefect

    # The server copies the UI assets (~17 MB) once per prefect version next to the package; where that
    # folder cannot be written (a read-only install), it copies them into the Prefect home instead.
    if not os.access(Path(prefect.__ui_static_subpath__).parent, os.W_OK):
        env.setdefault("PREFECT_UI_STATIC_DIRECTORY", str(home / "ui"))
    return env


def _spawn(name: str, args: list[str], home: Path, env: dict[str, str]) -> int:
    log = open(home / f"{name}.log", "ab")
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    (home / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def wait_healthy(port: int, timeout: float = 180.0) -> None:
    """Block until the server answers /api/health, or raise with a hint."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/api/health"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"Prefect server on 127.0.0.1:{port} did not become healthy in {timeout:.0f}s; "
                       "see server.log in the Prefect home")


def start(home: Path, port: int = 4200) -> dict[str, int]:
    """Start server, work pool, deployments and worker; return their PIDs."""
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    ui_assets()
    env = server_env(home, port)
    pids = {"server": _spawn("server", [*_prefect(), "server", "start", "--host", "127.0.0.1",
                                        "--port", str(port)], home, env)}
    try:
        wait_healthy(port)
        run = {"cwd": REPO_ROOT, "env": env, "check": True, "capture_output": True, "text": True}
        subprocess.run([*_prefect(), "work-pool", "create", POOL, "--type", "process", "--overwrite"], **run)
        subprocess.run([*_prefect(), "--no-prompt", "deploy", "--all"], **run)
        pids["worker"] = _spawn("worker", [*_prefect(), "worker", "start", "--pool", POOL], home, env)
    except BaseException:
        stop(home)
        raise
    return pids


def _stop_pid(pid: int, grace: float) -> None:
    # Each service leads its own process group (start_new_session), so its children go with it.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            try:  # reap it if it is our child
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            time.sleep(0.2)


def stop(home: Path, grace: float = 10.0) -> list[str]:
    """Stop the worker then the server (SIGTERM, then SIGKILL after ``grace`` s); return what was stopped."""
    stopped = []
    for name in ("worker", "server"):
        pid_file = home / f"{name}.pid"
        if pid_file.is_file():
            _stop_pid(int(pid_file.read_text()), grace)
            pid_file.unlink()
            stopped.append(name)
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.serve")
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--home", type=Path, default=REPO_ROOT / ".prefect")
    parser.add_argument("--port", type=int, default=4200)
    args = parser.parse_args(argv)
    if args.action == "stop":
        stopped = stop(args.home)
        print("stopped " + (", ".join(stopped) if stopped else "nothing (no PID files)"))
        return 0
    pids = start(args.home, args.port)
    print(f"Prefect UI: {ui_url(args.port)}   (runs: Artifacts tab = counts, buckets, quarantine, training "
          "metrics; Logs tab = one line per stage)")
    print(f"Prefect server PID {pids['server']}, worker PID {pids['worker']} on pool {POOL}, deployments from "
          f"prefect.yaml registered; state in {args.home}")
    print(f"  export PREFECT_API_URL={ui_url(args.port)}/api")
    print("  prefect deployment run 'prep-then-train/demo' --watch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
