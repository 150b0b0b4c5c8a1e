"""glibc allocator tuning for the prep processes: a cap on malloc arenas and a periodic ``malloc_trim``.

A long prep's resident set crept up with the number of units it ran: its task threads and per-unit decode
threads fragment glibc's arenas, and freed memory stays in them. ``tune_allocator`` caps the arenas once per
process and ``release_memory`` (after each unit, ``StageDir.run_unit``) hands free memory back to the OS.
Both are no-ops off glibc, or with ``LATENTMILL_NO_TRIM=1``. ``rebuilt`` keeps a long-lived structure out
of the small-object arenas that a burst of short-lived objects grew (CPython's own allocator).

Kept apart from ``latentmill.stages.shardio`` (which calls ``release_memory``) because it is process-level
memory policy, not shard I/O: ``ctypes`` into libc and module-level state (the trim counter and its lock).
Tests that change ``TRIM_EVERY_UNITS`` or read ``_units_since_trim`` patch this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc_malloc() -> tuple[Any, Any, Any]:
    """glibc's ``malloc_trim``, ``mallinfo2`` and ``mallopt`` (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None, None, None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim, opt = libc.malloc_trim, libc.mallopt
    except (OSError, AttributeError):
        return None, None, None
    info = getattr(libc, "mallinfo2", None)  # glibc >= 2.33
    if info is not None:
        info.restype = _MallInfo2
    return trim, info, opt


_malloc_trim, _mallinfo2, _mallopt = _glibc_malloc()
_M_ARENA_MAX = -8
TRIM_FREE_BYTES = 64 << 20  # trim when the heap holds at least this much free memory...
TRIM_EVERY_UNITS = 1  # ...at most once every this many units of the process
_units_since_trim = 0
_trim_lock = threading.Lock()


def tune_allocator(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas for this process (call before the worker threads start).

    glibc gives threads up to 8 arenas per core; the prep's task threads and per-unit decode threads each
    fragment their own, and the resident set of a long prep crept up with the number of units (peak RSS
    at 10x the data: 1.26x the 1x peak; with 2 arenas: 1.20x, at no measured cost in speed).
    """
    if _mallopt is not None and os.environ.get("LATENTMILL_NO_TRIM") != "1":
        _mallopt(_M_ARENA_MAX, int(arenas))


def release_memory() -> None:
    """Hand the allocator's free memory back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Called after each unit: every ``TRIM_EVERY_UNITS``-th call trims when the arenas hold at least
    ``TRIM_FREE_BYTES`` free. Trimming bounds the creep of fragmented free memory (a 20,000-sample cache
    stage under the flow held 130 MB of it at the end); the next unit faults its pages back in, which
    counted no more page faults over that stage than trimming every 8th unit. Trimming after every cache
    *batch* cost ~10%.
    """
    global _units_since_trim
    if _malloc_trim is None or os.environ.get("LATENTMILL_NO_TRIM") == "1":
        return
    with _trim_lock:
        _units_since_trim += 1
        if _units_since_trim < TRIM_EVERY_UNITS:
            return
        _units_since_trim = 0
    if _mallinfo2 is not None and _mallinfo2().fordblks < TRIM_FREE_BYTES:
        return
    _malloc_trim(0)


def trim_now() -> None:
    """Hand glibc's free memory back to the OS now (a prep between stages: the last stage's plan, records
    and their JSON texts are freed, at 100,000 inputs ~50 MB that would stay resident through the next stage)."""
    if _malloc_trim is not None and os.environ.get("LATENTMILL_NO_TRIM") != "1":
        _malloc_trim(0)


def rebuilt(items: list[T], encode: Callable[[T], Any], decode: Callable[[Any], T],
            collect: bool = True) -> list[T]:
    """``items`` rebuilt from one JSON text after the originals (and the cyclic garbage around them) are gone.

    CPython keeps small objects in 1 MiB arenas and returns an arena only once every object in it is gone.
    A structure made during a burst of short-lived small objects (a plan over 100,000 files, a stage's
    records parsed with their per-sample detail) sits scattered over the arenas the burst grew, keeps them
    alive, and whatever is allocated next fills their holes and pins them for the rest of the process.
    Rebuilt once the burst is freed, the structure sits in a few compact arenas of its own. ``encode`` and
    ``decode`` turn an item into JSON values and back; the text never leaves the process. ``items`` (the
    caller's only reference to the originals) is emptied. ``collect``: run the cyclic garbage collector in
    between (~0.45 s in a prep process, unless inside :func:`burst`, where it walks only the burst's
    objects); without it only what reference counting frees is gone (enough for parsed JSON).
    """
    text = json.dumps([encode(item) for item in items], separators=(",", ":"))
    del items[:]
    if collect:
        with signals_deferred():
            gc.collect()  # the burst's cyclic garbage too, before anything is allocated again
    return [decode(value) for value in json.loads(text)]


@contextlib.contextmanager
def burst() -> Iterator[None]:
    """A block whose own garbage :func:`rebuilt` collects: the objects older than the block are set aside.

    ``gc.collect`` walks every object the collector tracks, and a prep process holds ~800,000 of them
    before its first plan (torch, diffusers, transformers, Prefect): ~0.45 s a collection, whatever the
    plan's size. Every prep and refresh paid it in ``ingest.plan`` (figure 5: a refresh of 8 new images
    at 800 took 2.1 s instead of 1.1, Prefect rounding the flow run up to whole seconds; the plan itself
    took 0.02 s). Inside the block the older objects are frozen (``gc.freeze``), so a collection walks
    only what the block made; they are unfrozen when it ends. A process that froze objects itself is left
    as it is (the collection then walks what it did before).
    """
    own = gc.get_freeze_count() == 0
    if own:
        gc.freeze()
    try:
        yield
    finally:
        if own:
            gc.unfreeze()


class StartupFrozen:
    """The collector kept out of a command's start-up, and the start-up's objects out of its collections.

    A prep process imports torch, diffusers, transformers and Prefect before its first stage: ~800,000
    objects that live as long as the process. While they are made, CPython's collector walks all of them
    again each time they have grown by a quarter (a prep of 2,000 images ran 10 full collections, 1.5 s, of
    which 8 in the imports), and every full collection of the run after them walks them once more. Entered,
    the collector is off; :meth:`settle` (before the work starts) collects once, freezes what is alive
    (``gc.freeze``: moved out of the collected generations) and turns the collector back on; leaving the
    block unfreezes them, so a process that runs several commands (tests, a notebook) collects everything
    as before. A process that froze objects itself, or runs with the collector off, is left as it is.
    """

    def __init__(self) -> None:
        self._enabled = False
        self._frozen = contextlib.ExitStack()  # the burst() that freezes the start-up, once settled

    def __enter__(self) -> "StartupFrozen":
        self._enabled = gc.isenabled() and gc.get_freeze_count() == 0
        if self._enabled:
            gc.disable()
        return self

    def settle(self) -> None:
        """The start-up is done: collect its garbage, freeze what lives on, collect as usual from here."""
        if self._enabled and not gc.isenabled():
            with signals_deferred():
                gc.collect()
            self._frozen.enter_context(burst())  # the run is the burst; the start-up, the older objects
            gc.enable()

    def __exit__(self, *exc: object) -> None:
        self._frozen.close()
        if self._enabled:
            gc.enable()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Run the block with SIGINT and SIGTERM held back, then deliver them.

    A Python signal handler runs in whatever Python code the main thread executes when the signal arrives.
    During ``gc.collect`` that is often a weakref callback or a finalizer, where an exception (Prefect's
    ``TerminationSignal``, ``KeyboardInterrupt``) is printed as "Exception ignored" and lost: a run stopped
    with SIGTERM during the collection went on training. Here the handlers only note the signal; the real
    handler is called once the block is done. Off the main thread (where handlers cannot be set) the
    block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):  # a Python-level handler (not SIG_DFL / SIG_IGN, which need nothing)
            saved[sig] = handler
            signal.signal(sig, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in caught:
            saved[sig](sig, None)
