"""Checking cache shards while a run reads them: ``LazyShardCheck`` hashes a shard the first time it is read.

``trainer.verify_shards: true`` hashes every shard before the first step (``loader.verify_shards``); a large
cache then waits for a full pass over its bytes. By default the loader instead hands each shard to a
``LazyShardCheck`` when a batch first reads from it: a background thread hashes it against its manifest
entry while training goes on, and the trainer stops at the next step once a shard is found damaged (see
``latentmill.trainer.train``). A checkpoint and the end of a run wait for the checks of every shard read so
far, so neither ever rests on a shard that was not checked.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class CorruptShardError(ValueError):
    """A cache shard's bytes differ from what its manifest records (a flipped byte, a replaced file)."""


class LazyShardCheck:
    """Checks shards by number in a background thread, each once, in the order they are first ``touch``-ed.

    ``check(shard)`` returns what is wrong with shard number ``shard`` (a line naming it), or None. The
    thread starts at the first ``touch``; ``failure`` is the first problem found (then nothing more is
    checked); ``wait()`` blocks until every touched shard is checked; ``close()`` stops the thread.
    """

    def __init__(self, check: Callable[[int], str | None], *, name: str = "latent-shard-check") -> None:
        self._check, self._name = check, name
        self._seen: set[int] = set()
        self._queue: deque[int] = deque()
        self._cond = threading.Condition()
        self._busy = False  # the thread is checking a shard it took from the queue
        self._closed = False
        self._dropped = False  # close() found shards still waiting
        self._thread: threading.Thread | None = None
        self.failure: str | None = None
        self.checked = 0  # shards checked so far (tests, logs)

    def touch(self, shards: Iterable[int]) -> None:
        """Queue the shards in ``shards`` that were never queued before (cheap for seen ones)."""
        new = [s for s in shards if s not in self._seen]
        if not new:
            return
        with self._cond:
            for shard in new:
                if shard not in self._seen:
                    self._seen.add(shard)
                    self._queue.append(shard)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @property
    def touched(self) -> int:
        """How many distinct shards were queued so far."""
        return len(self._seen)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every touched shard is checked (or one failed); False if ``timeout`` ran out first or
        ``close`` dropped shards that were still waiting."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.failure is not None or self._closed or (not self._queue and not self._busy), timeout
            ) and not self._dropped

    def close(self) -> None:
        """Stop the thread after the shard it is checking (the rest of the queue is dropped)."""
        with self._cond:
            self._closed = True
            self._dropped = self._dropped or bool(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed or self.failure is not None:
                    return
                shard = self._queue.popleft()
                self._busy = True
            try:
                problem = self._check(shard)
            except Exception as err:  # an unreadable shard is a bad shard, said in the same words
                problem = f"shard {shard}: cannot be checked ({err!r})"
            with self._cond:
                self._busy = False
                self.checked += 1
                if problem is not None and self.failure is None:
                    self.failure = problem
                    log.error("%s", problem)
                self._cond.notify_all()
