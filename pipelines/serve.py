"""Start and stop a local Prefect server, a process work pool and worker, and the deployments.

    latentmill serve start [--port 4200] [--home .prefect]    (what `make serve` runs)
    latentmill serve stop  [--home .prefect]                  (what `make serve-stop` runs)

The deployments are those of the package's ``prefect.yaml`` (module-path entrypoints: a worker needs the
installed package, not a checkout); flow runs execute in the folder ``start`` was run from.

Everything listens on 127.0.0.1 and keeps its state (SQLite, logs, PIDs, port) under ``--home``, which
becomes ``PREFECT_HOME``. The server also serves the Prefect UI at ``http://127.0.0.1:PORT`` (the assets ship
in the installed ``prefect`` package): each run's Artifacts tab holds the prep counts, bucket histogram,
quarantine reasons and training metrics, its Logs tab one line per stage. The tests use the same functions
with a temporary home and a free port.

One home runs one server and one worker: a second ``start`` reuses them (same port) or refuses (another
port), and ``stop`` stops every process ``start`` started, flow runs and their children included. Each of
them carries ``LATENTMILL_SERVE_HOME=<home>`` in its environment (the worker passes it on to its flow runs,
which lead process groups of their own), and ``stop`` finds them by it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

DEPLOYMENTS = Path(__file__).resolve().parent / "prefect.yaml"  # shipped with the package
POOL = "latentmill-process"
HOME_MARKER = "LATENTMILL_SERVE_HOME"  # in the environment of every process started from a home
SERVICES = ("worker", "server")  # stopped in this order: the worker may still report its runs to the server


class ServeError(RuntimeError):
    """A home's services cannot be started as asked (another port, a port in use, a server that died)."""


@dataclasses.dataclass(frozen=True)
class Services:
    """The server and worker of a home: their PIDs, the port, and which of them were already running."""

    server: int
    worker: int
    port: int
    reused: tuple[str, ...] = ()  # "server", "worker": found running from this home, not started

    def pids(self) -> dict[str, int]:
        return {"server": self.server, "worker": self.worker}


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
        # `prefect deployment run --watch` prints a run's logs only when the server streams them (off by
        # default): without it a failed run ended "Flow run finished in state 'Failed'." and nothing more
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
        "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
        "LATENTMILL_ROOT": str(Path.cwd()),  # prefect.yaml's pull step runs flows from here
        HOME_MARKER: str(home.resolve()),
    })
    import prefect

    # The server copies the UI assets (~17 MB) once per prefect version next to the package; where that
    # folder cannot be written (a read-only install), it copies them into the Prefect home instead.
    if not os.access(Path(prefect.__ui_static_subpath__).parent, os.W_OK):
        env.setdefault("PREFECT_UI_STATIC_DIRECTORY", str(home / "ui"))
    return env


def _spawn(name: str, args: list[str], home: Path, env: dict[str, str]) -> int:
    with open(home / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(args, cwd=Path.cwd(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    (home / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _from_home(proc: psutil.Process, home: Path, recorded: bool = False) -> bool:
    """Whether ``proc`` was started from ``home`` (its environment says so), and has not exited.

    A ``recorded`` PID (a PID file's) also counts when it runs ``prefect`` with ``PREFECT_HOME=home``: the
    services of a home started before the marker existed.
    """
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        environ = proc.environ()
        if HOME_MARKER in environ:
            return environ[HOME_MARKER] == str(home)
        return recorded and environ.get("PREFECT_HOME") == str(home) and "prefect" in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _recorded(home: Path, name: str) -> int | None:
    try:
        return int((home / f"{name}.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None


def running(home: Path) -> dict[str, int]:
    """The services of ``home`` whose recorded PID is alive and is still the process started from it."""
    home = home.resolve()
    alive = {}
    for name in SERVICES:
        pid = _recorded(home, name)
        if pid is not None and psutil.pid_exists(pid) and _from_home(psutil.Process(pid), home, recorded=True):
            alive[name] = pid
    return alive


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as `prefect server start` checks it
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_healthy(port: int, timeout: float = 180.0, pid: int | None = None) -> None:
    """Block until the server answers /api/health, or raise with a hint (at once if process ``pid`` exits)."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/api/health"
    while time.monotonic() < deadline:
        if pid is not None and not _alive(pid):
            raise ServeError(f"the Prefect server (PID {pid}) exited while starting; see server.log in the "
                             "Prefect home")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"Prefect server on 127.0.0.1:{port} did not become healthy in {timeout:.0f}s; "
                       "see server.log in the Prefect home")


def _alive(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our child, and it has exited: reap it
            return False
    except ChildProcessError:
        pass
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start(home: Path, port: int = 4200) -> Services:
    """Start server, work pool, deployments and worker, or reuse the ones this home already runs.

    Raises ``ServeError`` when this home's server runs on another port, or the port is taken by a process
    that is not this home's server.
    """
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    ui_assets()
    env = server_env(home, port)
    alive = running(home)
    reused = tuple(name for name in SERVICES if name in alive)
    if "server" in alive:
        old_port = int((home / "server.port").read_text()) if (home / "server.port").is_file() else None
        if old_port != port:
            raise ServeError(f"this Prefect home ({home}) already runs a server (PID {alive['server']}) on "
                             f"port {old_port}: use that port, or stop it first (make serve-stop)")
        wait_healthy(port, pid=alive["server"])
    else:
        reused = ()
        stop(home)  # what is left of an earlier start (a worker whose server died, stale PID files)
        if not _port_free(port):
            raise ServeError(f"port {port} on 127.0.0.1 is in use by another process (not a server of {home}); "
                             "choose another port (make serve PORT=...)")
    try:
        if "server" not in alive:
            alive["server"] = _spawn("server", [*_prefect(), "server", "start", "--host", "127.0.0.1",
                                                "--port", str(port)], home, env)
            (home / "server.port").write_text(str(port))
            wait_healthy(port, pid=alive["server"])
        # (re)register the pool and prefect.yaml's deployments: a second start picks up an edited prefect.yaml
        run = {"cwd": Path.cwd(), "env": env, "check": True, "capture_output": True, "text": True}
        subprocess.run([*_prefect(), "work-pool", "create", POOL, "--type", "process", "--overwrite"], **run)
        subprocess.run([*_prefect(), "--no-prompt", "deploy", "--all", "--prefect-file", str(DEPLOYMENTS)], **run)
        if "worker" not in alive:
            alive["worker"] = _spawn("worker", [*_prefect(), "worker", "start", "--pool", POOL], home, env)
    except BaseException:
        if "server" not in reused:  # a failed second start leaves the running server alone
            stop(home)
        raise
    return Services(alive["server"], alive["worker"], port, reused)


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    # A process that leads its group (the services, each flow run) takes its group with it: children that
    # left the home's environment behind (none should) go too.
    for proc in procs:
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


def _stop_procs(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace`` s; return when all have exited (and are reaped)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        _signal_all(procs, sig)
        _, procs = psutil.wait_procs(procs, timeout=wait)  # reaps our own children too
        if not procs:
            return


def from_home(home: Path) -> list[psutil.Process]:
    """Every live process started from ``home`` (by ``start`` or by a process it started), but this one."""
    home = home.resolve()
    recorded = {_recorded(home, name) for name in SERVICES}
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    return [p for p in psutil.process_iter()
            if p.pid not in mine and _from_home(p, home, recorded=p.pid in recorded)]


def stop(home: Path, grace: float = 10.0) -> list[tuple[str, int]]:
    """Stop everything started from ``home``: the worker with its flow runs, then the server.

    SIGTERM first, SIGKILL after ``grace`` s. Returns ``(what, pid)`` for each process that was running:
    ``worker``, ``server``, or ``process`` for the others (flow runs, their children).
    """
    home = home.resolve()
    procs = from_home(home)
    recorded = {_recorded(home, name): name for name in SERVICES}
    server = [p for p in procs if recorded.get(p.pid) == "server"]
    rest = [p for p in procs if recorded.get(p.pid) != "server"]
    _stop_procs(rest, grace)
    _stop_procs(server, grace)
    for name in ("worker.pid", "server.pid", "server.port"):
        (home / name).unlink(missing_ok=True)
    order = {"worker": 0, "server": 1}
    stopped = [(recorded.get(p.pid, "process"), p.pid) for p in procs]
    return sorted(stopped, key=lambda item: (order.get(item[0], 2), item[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="latentmill serve")
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--home", type=Path, default=Path(".prefect"))
    parser.add_argument("--port", type=int, default=4200)
    args = parser.parse_args(argv)
    if args.action == "stop":
        stopped = stop(args.home)
        names = [f"{what} (PID {pid})" for what, pid in stopped]
        print("stopped " + (", ".join(names) if names else f"nothing: no process from {args.home.resolve()} runs"))
        return 0
    try:
        services = start(args.home, args.port)
    except ServeError as err:
        print(f"serve: error: {err}", file=sys.stderr)
        return 1
    print(f"Prefect UI: {ui_url(args.port)}   (runs: Artifacts tab = counts, buckets, quarantine, training "
          "metrics; Logs tab = one line per stage)")
    if services.reused:
        started = " (the worker had exited: started a new one)" if "worker" not in services.reused else ""
        print(f"Already running from {args.home}: Prefect server PID {services.server}, worker PID "
              f"{services.worker}{started} on pool {POOL}; deployments from prefect.yaml registered again")
    else:
        print(f"Prefect server PID {services.server}, worker PID {services.worker} on pool {POOL}, deployments "
              f"from prefect.yaml registered; state in {args.home}")
    print(f"  export PREFECT_API_URL={ui_url(args.port)}/api")
    print("  prefect deployment run 'prep-then-train/demo' --watch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
