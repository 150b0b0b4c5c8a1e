"""Prefect's temporary local API for command-line runs, tied to the life of the run.

With no ``PREFECT_API_URL``, Prefect 3 starts ``uvicorn prefect.server.api.server`` as a subprocess
(``SubprocessASGIServer``) and stops it from an ``atexit`` hook. A ``kill`` (SIGTERM) or ``kill -9`` of the
run skips ``atexit``, and the server, reparented to PID 1, stayed alive with ~220 MB. Here the server is
started with a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel sends it SIGTERM when the
process that started it ends, however it ends. The server is the same one Prefect would start, at the same
moment of the run, so start-up costs what it did.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # looked up here: the child between fork and exec should do as little as possible


def _die_with_parent() -> None:
    """``preexec_fn``: ask the kernel for SIGTERM when the parent (the thread that forks) ends."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


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
