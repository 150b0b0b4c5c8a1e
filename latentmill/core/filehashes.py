"""``FileHashes``: the sha256 of local input files, remembered across runs in a SQLite store.

The ingest planner, the source listers and the model fingerprints hash files by their content; this keeps
those digests by ``(size, mtime_ns, inode)`` so a refresh does not re-read unchanged bytes. It is a small
persistent cache with its own locking and SQLite schema, not shard I/O, hence its own module (built on
``latentmill.core.hashing.sha256_file``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from latentmill.core.hashing import sha256_file


class FileHashes:
    """sha256 of local files, remembered by ``(size, mtime_ns, inode)`` across runs in a SQLite file.

    A refresh lists every input again; without this it re-reads every byte to find that nothing changed.
    A remembered digest is used only while the file's size, mtime and inode are what they were when it
    was hashed. Like git's index, a file hashed within ``RACY_SECONDS`` of its last modification is not
    remembered (a second write in the same mtime tick could keep the stat and change the bytes).

    The store is never loaded whole (a million files cost no memory): it is looked up a file at a time, or
    a group of files in a few queries by ``prefetch`` (a planner's unit at a time: one query per file made
    half of a refresh's listing time). Nor is what this instance learns held whole: past ``FLUSH_ROWS``, its
new digests and the paths it was asked for are appended to temporary tables of its connection (SQLite's
temporary files, never synced; appended, not indexed, so each row is written about once), which ``save``
writes from. The store is written by ``save`` alone, in one
transaction; several processes may share one (SQLite locks it). A missing, locked or damaged store only
means hashing again. Thread-safe.
    """

    PREFETCH_CHUNK = 500  # paths per query (SQLite allows 999 parameters by default on old builds)
    FLUSH_ROWS = 2048  # new digests, and paths asked for, held in memory before they move to SQLite

    RACY_SECONDS = 2.0

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._db = None
        self._new: dict[str, tuple[int, int, int, str]] = {}  # hashed by this instance, to remember
        self._seen: set[str] = set()  # files asked for (what ``save`` keeps when forgetting)
        self._moved = 0  # digests moved to the ``new`` temporary table (and the paths to ``seen``) by ``_flush``
        self._seen_lost = False  # some path asked for could not be kept: ``save`` forgets nothing
        self._prefetched: dict[str, tuple] = {}  # the rows of the last ``prefetch`` (one group of files)
        self._signatures: dict[str, str] = {}  # signature -> value, remembered by this instance (``save``)
        self._lock = threading.Lock()
        self.hashed = 0  # files read and hashed by this instance (the rest came from the store)
        if self.path is not None and self.path.is_file():
            self._db = self._connect()

    def _connect(self):
        import sqlite3

        try:
            db = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
            db.execute("CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, size INTEGER, "
                       "mtime_ns INTEGER, ino INTEGER, sha256 TEXT)")
            db.execute("CREATE TABLE IF NOT EXISTS signatures (signature TEXT PRIMARY KEY, value TEXT)")
            return db
        except sqlite3.Error:
            return None

    def prefetch(self, paths: list[str]) -> None:
        """Look the remembered rows of ``paths`` up in a few queries and keep them until the next
        ``prefetch`` (which replaces them): the next ``sha256`` calls for these files ask SQLite nothing."""
        import sqlite3

        keys = [os.path.abspath(p) for p in paths]
        found: dict[str, tuple] = {}
        if self._db is not None:
            try:
                with self._lock:
                    for i in range(0, len(keys), self.PREFETCH_CHUNK):
                        chunk = keys[i:i + self.PREFETCH_CHUNK]
                        rows = self._db.execute(
                            "SELECT path, size, mtime_ns, ino, sha256 FROM files WHERE path IN "
                            f"({','.join('?' * len(chunk))})", chunk).fetchall()
                        found.update((row[0], row[1:]) for row in rows)
            except sqlite3.Error:
                found = {}
        with self._lock:
            self._prefetched = {key: found.get(key) for key in keys}

    def touch(self, paths: list[str]) -> None:
        """Count ``paths`` as asked for without looking them up (``save`` keeps their digests)."""
        keys = [os.path.abspath(p) for p in paths]
        with self._lock:
            self._seen.update(keys)
            if len(self._seen) >= self.FLUSH_ROWS:
                self._flush()

    def signature(self, signature: str) -> str | None:
        """The value remembered for a metadata signature (the ingest planner's: a unit id), or None."""
        import sqlite3

        if self._db is None:
            return None
        try:
            with self._lock:
                row = self._db.execute("SELECT value FROM signatures WHERE signature = ?", (signature,)).fetchone()
        except sqlite3.Error:
            return None
        return row[0] if row else None

    def remember_signature(self, signature: str, value: str) -> None:
        """Remember ``value`` for ``signature`` at ``save``; the signatures not remembered again by this
        instance are then forgotten (with ``forget_unused``)."""
        with self._lock:
            self._signatures[signature] = value

    def _known(self, key: str) -> tuple | None:
        import sqlite3

        if key in self._prefetched:
            return self._prefetched[key]
        if self._db is None:
            return None
        try:
            with self._lock:
                return self._db.execute("SELECT size, mtime_ns, ino, sha256 FROM files WHERE path = ?",
                                        (key,)).fetchone()
        except sqlite3.Error:
            return None

    def sha256(self, path: str | Path) -> str:
        """The hex sha256 of the file at ``path`` (its absolute path is the key)."""
        key = os.path.abspath(path)
        st = os.stat(key)
        stat = (st.st_size, st.st_mtime_ns, st.st_ino)
        known = self._known(key)
        with self._lock:
            self._seen.add(key)
            if len(self._seen) >= self.FLUSH_ROWS:
                self._flush()
        if known is not None and tuple(known[:3]) == stat:
            return known[3]
        digest = sha256_file(key)
        with self._lock:
            self.hashed += 1
            if time.time() - st.st_mtime_ns / 1e9 >= self.RACY_SECONDS:
                self._new[key] = (*stat, digest)
                if len(self._new) >= self.FLUSH_ROWS:
                    self._flush()
        return digest

    def _store(self):
        """The store's connection, opened (and the store made) if need be; None when it cannot be."""
        if self._db is None and self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError:
                return None
            self._db = self._connect()
        return self._db

    def _flush(self) -> None:
        """Move the new digests and the paths asked for into the connection's temporary tables ``new`` and
        ``seen`` (the lock held). Without a connection they are dropped: those files are only hashed again,
        and ``save`` forgets nothing."""
        import sqlite3

        db = self._store()
        try:
            if db is None:
                raise sqlite3.OperationalError("no store")
            db.execute("CREATE TEMP TABLE IF NOT EXISTS seen (path TEXT)")
            db.execute("CREATE TEMP TABLE IF NOT EXISTS new (path TEXT, size INTEGER, mtime_ns INTEGER, ino INTEGER, "
                       "sha256 TEXT)")
            db.execute("BEGIN")  # one transaction, not one per row (the connection commits each statement)
            try:
                db.executemany("INSERT INTO temp.seen VALUES (?)", ((k,) for k in self._seen))
                db.executemany("INSERT INTO temp.new VALUES (?, ?, ?, ?, ?)", ((k, *v) for k, v in self._new.items()))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._moved += len(self._new)
        except sqlite3.Error:
            self._seen_lost = True
        self._seen.clear()
        self._new.clear()

    def save(self, forget_unused: bool = True, listed: int | None = None,
             list_files: Callable[[], Iterable[str]] | None = None) -> None:
        """Remember the digests hashed since opening; with ``forget_unused`` also forget the files this
        instance was not asked for (a dataset's own store), without it keep them (a shared store).

        ``listed`` and ``list_files``: for a caller that asks for only some of its files (the ingest planner
        asks nothing about an unchanged unit's): how many files it has, and a function that names them all.
        They are named, and the rest forgotten, only when the store holds more than ``listed`` files, so a
        refresh that removed no file pays nothing per file here."""
        import sqlite3

        if self.path is None or (not self._new and not self._moved and not self._signatures and not forget_unused):
            return
        try:
            with self._lock:
                db = self._store()
                if db is None:
                    return
                self._flush()
                db.execute("BEGIN IMMEDIATE")
                try:
                    if self._moved:  # in path order; a path hashed twice: its last digest
                        db.execute("INSERT OR REPLACE INTO files SELECT path, size, mtime_ns, ino, sha256 FROM temp.new "
                                   "ORDER BY path, rowid")
                    if forget_unused:
                        db.execute("DELETE FROM signatures")
                    db.executemany("INSERT OR REPLACE INTO signatures VALUES (?, ?)", sorted(self._signatures.items()))
                    # Forgetting runs only when the store holds more rows than files were asked for (or, with
                    # ``list_files``, listed): some row is then surely unused (a file deleted or moved). A
                    # leftover row is harmless: it is used only for a file whose path, size, mtime and inode
                    # all match it.
                    if forget_unused and not self._seen_lost:
                        stored = db.execute("SELECT COUNT(*) FROM files").fetchone()[0]
                        if list_files is None or stored > (listed or 0):
                            if list_files is not None:
                                db.executemany("INSERT INTO temp.seen VALUES (?)",
                                               ((os.path.abspath(p),) for p in list_files()))
                            db.execute("CREATE INDEX IF NOT EXISTS temp.seen_path ON seen (path)")  # built sorted, once
                            if stored > db.execute("SELECT COUNT(DISTINCT path) FROM temp.seen").fetchone()[0]:
                                db.execute("DELETE FROM files WHERE NOT EXISTS "
                                           "(SELECT 1 FROM temp.seen s WHERE s.path = files.path)")
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                if self._moved:
                    db.execute("DELETE FROM temp.new")
                    self._moved = 0
                self._signatures.clear()
        except (sqlite3.Error, OSError):
            pass  # a read-only or busy store: the digests are only remembered for this process

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
