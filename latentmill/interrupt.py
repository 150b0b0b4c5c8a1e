"""Stopping a run at a safe point when it is asked to (Ctrl-C, SIGTERM from SLURM, Kubernetes or a Prefect worker).

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread happens to be, and never in the
threads that do the work: a prep's task runner then waited for its in-flight task (a whole group of cache
units), and training stopped in the middle of a step. Inside :func:`stop_on_signals` the signals only note
the request (:func:`request`); the work asks :func:`check` at its safe points (before each prep unit and
after each sample it writes, after each optimizer step) and raises :class:`Interrupted` there. A second
Ctrl-C raises ``KeyboardInterrupt`` at once, for a user who does not want to wait.

The request is process-wide, not per thread: the prep's worker threads see the signal the main thread got.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run stopped at a safe point because SIGINT or SIGTERM asked it to.

    A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` on the way (a stage's error
    policy, Prefect's task retries) takes it for a failure of the work.
    """

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__(signum, detail)
        self.signum, self.detail = int(signum), detail

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum

    def __str__(self) -> str:
        return self.detail or f"stopped by {signal.Signals(self.signum).name}"


_lock = threading.Lock()
_requested: int | None = None  # the signal that asked first (SIGTERM wins over SIGINT: it also asks to save)
_depth = 0  # nesting of stop_on_signals (the CLI around the whole command, the trainer around its loop)


def request(signum: int) -> None:
    """Ask the work of this process to stop at its next safe point (what the signal handlers do)."""
    global _requested
    with _lock:
        if _requested is None or signum == signal.SIGTERM:
            _requested = int(signum)


def requested() -> int | None:
    """The signal number that asked this process to stop, or None."""
    return _requested


def clear() -> None:
    """Forget a request (a new command in the same process starts afresh)."""
    global _requested
    with _lock:
        _requested = None


def check(detail: str = "") -> None:
    """Raise :class:`Interrupted` when a stop was asked for (call at a safe point: nothing half-written kept)."""
    signum = _requested
    if signum is not None:
        raise Interrupted(signum, detail)


def _handler(signum: int, frame: Any) -> None:
    if signum == signal.SIGINT and _requested is not None:
        raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the safe point
    request(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM ask for a stop (:func:`request`) instead of raising where they land.

    Blocks nest (the CLI around a command, the prep flow and the trainer around their loops); the
    outermost one clears an earlier request when it starts and when it ends. When the outermost block
    leaves after a request, the handler that was there before it gets the signal too, when that is a
    Python handler other than the default ``KeyboardInterrupt``: in a flow run that a Prefect worker
    cancels with SIGTERM, Prefect's bridge then raises its ``TerminationSignal`` and the run is marked
    Cancelled. Off the main thread, where handlers cannot be set, the block runs as it is (the main
    thread's handlers still see the signals).
    """
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        clear()
    saved = {sig: signal.signal(sig, _handler) for sig in SIGNALS}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for sig, previous in saved.items():
            signal.signal(sig, previous)
        if _depth == 0:
            signum, previous = _requested, saved.get(_requested)
            clear()
            if callable(previous) and previous is not _handler and previous is not signal.default_int_handler:
                previous(signum, None)


def stop_ranks(torchrun_pid: int) -> None:
    """SIGTERM to torchrun's ranks, not to torchrun: each stops after the same step and saves it
    (``trainer.train``), then exits, and torchrun ends as after a finished run.

    torchrun, signalled itself, stops its ranks too but ends on a traceback of its own; and a second signal
    while it waits for them (one from outside and this one) made it kill them before they had saved.
    """
    import psutil

    try:
        ranks = psutil.Process(torchrun_pid).children()
    except psutil.NoSuchProcess:
        return
    for rank in ranks:
        try:
            rank.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass


def run_ranks(cmd: list[str], tick: Any = None, tick_s: float = 5.0) -> tuple[int, int | None]:
    """Run torchrun's command ``cmd`` and wait for it, calling ``tick()`` every ``tick_s`` seconds meanwhile. It
    runs in a process group of its own that ends with this process, so a terminal's Ctrl-C reaches this process
    only; a SIGINT or SIGTERM here goes to the ranks once (:func:`stop_ranks`). Cancelled otherwise (an exception
    here), torchrun is terminated. Its exit status, and the signal that stopped the ranks (None if none did)."""
    import subprocess
    import time

    from latentmill.prefect_env import group_dying_with_parent

    own_group = group_dying_with_parent()
    with stop_on_signals(), subprocess.Popen(cmd, preexec_fn=own_group, start_new_session=own_group is None) as proc:
        try:
            stopped_by, ticked = None, time.monotonic()
            while True:
                try:
                    return proc.wait(timeout=0.2), stopped_by
                except subprocess.TimeoutExpired:
                    pass
                if requested() is not None and stopped_by is None:
                    stopped_by = requested()
                    stop_ranks(proc.pid)
                if tick is not None and time.monotonic() - ticked >= tick_s:
                    ticked = time.monotonic()
                    tick()
        except BaseException:  # cancelled or interrupted: torchrun stops its ranks on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise

