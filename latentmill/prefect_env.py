"""How a command runs its flow (the command line's and the Python API's alike), and Prefect's temporary local
API for it, tied to the life of the run.

:func:`run_command` is the one way a command runs: the command line (``latentmill.cli``) and the Python API
(``latentmill.api``) both call it.

With no ``PREFECT_API_URL``, Prefect 3 starts ``uvicorn prefect.server.api.server`` as a subprocess
(``SubprocessASGIServer``) and stops it from an ``atexit`` hook. A ``kill`` (SIGTERM) or ``kill -9`` of the
run skips ``atexit``, and the server, reparented to PID 1, stayed alive. Here the server is
started with a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel sends it SIGTERM when the
process that started it ends, however it ends. The server is the same one Prefect would start, at the same
moment of the run, so start-up costs what it did.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Prefect settings every command runs with unless the environment sets them: Prefect's telemetry service, left
# on, wrote into the temporary server's SQLite file while a flow run did and lost the lock ("database is
# locked"); a loaded machine can take longer than Prefect's 20 s to start the temporary API.
COMMAND_SETTINGS = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
T = TypeVar("T")


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # looked up here: the child between fork and exec should do as little as possible


def _die_with_parent() -> None:
    """``preexec_fn``: ask the kernel for SIGTERM when the parent (the thread that forks) ends, in a process
    group of its own.

    A Ctrl-C in a terminal signals the whole foreground process group. The server, in the run's group, quit
    at once while the run still had states and events to report: the run then retried against a closed
    port for over a minute and ended on ``ConnectError: [Errno 111] Connection refused``. In its own group
    it stays up while the run stops, and still ends with it.
    """
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgid(0, 0)


def group_dying_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that puts a child in a process group of its own and ends it with this process (the
    thread that starts it), or None where the platform has no ``prctl``."""
    return _die_with_parent if _PRCTL is not None else None


class _SubprocessDyingWithParent:
    """Stands in for the ``subprocess`` module inside ``prefect.server.api.server``: its ``Popen`` (only the
    uvicorn command uses it) adds the parent-death signal, Prefect's command and environment stay its own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 (the module's name for it)
        # The signal follows the *thread* that forks, not the process: a server started from a worker thread
        # would die with that thread. Only the main thread, which lives as long as the process, gets it.
        if threading.current_thread() is threading.main_thread() and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = _die_with_parent
        return subprocess.Popen(*args, **kwargs)


def ephemeral_api_needed() -> bool:
    """Whether Prefect would start a temporary local API server for a flow run in this process."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value())


def start_ephemeral_api() -> str | None:
    """Start Prefect's temporary API server (when the settings call for one) so that it dies with this process.

    Call it from the main thread before the first flow; Prefect's clients then reuse this server (it is a
    per-process singleton) and stop it at exit as before. Returns its API URL, or None when a server is
    configured (``PREFECT_API_URL``) or the platform has no ``prctl`` (Prefect then starts it as usual).
    """
    if _PRCTL is None or not ephemeral_api_needed():
        return None
    import prefect.server.api.server as server_module

    if not isinstance(server_module.subprocess, _SubprocessDyingWithParent):
        server_module.subprocess = _SubprocessDyingWithParent()
    server = server_module.SubprocessASGIServer()
    server.start()  # waits up to PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, as Prefect's own start does
    return server.api_url


class EarlyAPI:
    """Prefect's temporary API server, started by the command line before its heavy imports.

    A command-line run used to start the server when its first flow was about to run: ~4 s importing
    ``prefect.server.api.server`` in the CLI process, then ~8 s waiting for the server to boot, after ~5 s of
    importing the flows and checking the recipe. :func:`start_api_early` launches the same server command
    (the one ``SubprocessASGIServer`` runs, same environment, same parent-death signal) at once, without
    importing the server module here, and :meth:`ready` waits for it only when the first flow needs it, so
    the boot overlaps the rest of the start-up. The flows reach it through ``PREFECT_API_URL`` set for this
    process (:meth:`settings`); child processes keep their own settings, as before.
    """

    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port = process, port
        self.api_url = f"http://127.0.0.1:{port}/api"

    def ready(self, timeout: float) -> str:
        """Wait until the server answers ``/health``; its API URL. A server that exits first is an error."""
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"Prefect's temporary API server exited with status {code} before it answered "
                                   f"on port {self.port} (run with --debug for its log, or set PREFECT_API_URL)")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self.api_url
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prefect's temporary API server did not answer on port {self.port} within "
                                   f"{timeout:.0f} s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")
            time.sleep(0.1)

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """A context in which this process's Prefect clients use this server, in every thread.

        The settings are also the process-wide default while the context lasts: a thread started without a copy
        of the caller's context (the message forwarder of Prefect's ``ProcessPoolTaskRunner``, ``runner.kind:
        processes``) otherwise reads the settings of Prefect's import, without this URL, and starts a second
        temporary server for the events it forwards from the worker processes.
        """
        import prefect.context
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}):
            prior, prefect.context.GLOBAL_SETTINGS_CONTEXT = (prefect.context.GLOBAL_SETTINGS_CONTEXT,
                                                              prefect.context.SettingsContext.get())
            try:
                yield
            finally:
                prefect.context.GLOBAL_SETTINGS_CONTEXT = prior

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_early: EarlyAPI | None = None  # one per process: a second command run in the same process reuses it


def start_api_early() -> EarlyAPI | None:
    """Launch Prefect's temporary API server now, when the settings call for one (no ``PREFECT_API_URL``);
    None otherwise, or where there is no ``prctl`` (Prefect then starts its own as usual). Main thread only.

    One server per process, as Prefect's own ephemeral server: ``latentmill.cli.main`` called several times
    in one process (tests, notebooks) reuses the server while it runs, instead of starting one per call.
    """
    global _early
    if _PRCTL is None or threading.current_thread() is not threading.main_thread() or not ephemeral_api_needed():
        return None
    if _early is not None and _early.process.poll() is None:
        return _early
    import atexit
    import socket

    import prefect
    from prefect.settings import get_current_settings

    with socket.socket() as sock:  # a free port; a race for it ends the server with status 3 (ready() says so)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
         "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "error",
         "--lifespan", "on"], env=env, preexec_fn=_die_with_parent)
    server = _early = EarlyAPI(process, port)
    atexit.register(server.stop)
    return server


def set_command_environment() -> None:
    """Put :data:`COMMAND_SETTINGS` into this process's environment where it has no value (the command line,
    before Prefect is imported): the servers, workers and training processes it starts inherit them."""
    for name, value in COMMAND_SETTINGS.items():
        os.environ.setdefault(name, value)


class _NoPrefectInfo(logging.Filter):
    """Drops Prefect's records below WARNING (run states, stage lines, the temporary server's notices)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("prefect")


@contextlib.contextmanager
def _quiet_console() -> Iterator[None]:
    """Prefect's console without its INFO lines for the length of a call; its API handler keeps them all.

    The command line gets this from ``PREFECT_LOGGING_LEVEL`` set before Prefect is imported; a library
    cannot set that for its caller's process, so the filter goes on Prefect's console handler and comes off.
    """
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()
    quiet = _NoPrefectInfo()
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in consoles:
            handler.removeFilter(quiet)


def run_command(prepare: Callable[[], Callable[[], T]], *, while_booting: Callable[[], None] | None = None,
                quiet_console: bool = False) -> T:
    """Run one command's flow: the command line's and the Python API's one way to do it.

    Prefect runs with :data:`COMMAND_SETTINGS` (a value in the environment wins). Prefect's temporary API server
    of this process is launched first (:func:`start_api_early`), so that it boots while ``prepare()`` imports
    the flows and checks what it must; ``prepare`` returns the call that runs the flow. ``while_booting()``
    overlaps more of the boot (only when the server was launched here), and once the server answers the flow
    runs against it. Without an early server (``PREFECT_API_URL`` set, no
    ``prctl``, not the main thread) the flow uses the configured server or Prefect's own temporary one, started
    here to die with this process where it can. ``quiet_console``: Prefect's INFO lines stay off the console
    (:func:`_quiet_console`; the Python API, whose caller's logging is not the command line's to set).
    """
    import prefect.settings

    # The environment's values, else the defaults, also when Prefect read its settings before they were set.
    settings = {getattr(prefect.settings, name): os.environ.get(name, value) for name, value in COMMAND_SETTINGS.items()}
    with prefect.settings.temporary_settings(settings):
        with _quiet_console() if quiet_console else contextlib.nullcontext():
            early_api = start_api_early()
            call = prepare()
            if early_api is not None:
                if while_booting is not None:
                    while_booting()
                early_api.ready(float(prefect.settings.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
                using = early_api.settings()
            else:
                start_ephemeral_api()
                using = contextlib.nullcontext()
            with using:
                return call()
