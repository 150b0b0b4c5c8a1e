"""A planner's scratch database: a source's entries streamed into SQLite, and ingest's grouping rule over them.

Ingest's plan lists a source entry by entry into this table (its listing position, id, id hash, estimated
bytes, fields and metadata signature) and groups it with queries, so planning holds one unit's entries in
memory, never the whole source; a refresh of a million files costs disk pages here, not Python objects. The
folder lister keeps each folder's names here too (up to ``FOLDER_MEMORY`` names in memory; a flat folder of a
million files is sorted by SQLite), and the list and manifest listers the counts that find repeated ids.

The grouping rule (:meth:`Scratch.groups`) is the one :func:`latentmill.stages.ingest.layout` and
:func:`latentmill.stages.ingest.hash_byte_groups` describe; those run it over an in-memory table. The file is
SQLite's own private temporary file (in ``SQLITE_TMPDIR`` or ``TMPDIR``, else ``/var/tmp`` or ``/tmp``),
which SQLite deletes when it is closed and leaves nothing behind when a process is killed; no journal, one
transaction from opening to closing (a statement's own commit would cost more than the statement).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from itertools import chain, islice
from typing import Any, Iterable, Iterator

CHUNK = 500  # rows per statement (SQLite allows 999 parameters by default on old builds)
FILE, LINK, FOLDER = 0, 1, 2  # a listed name's kind: a file, a symlink to a file, a folder
FOLDER_MEMORY = 65_536  # a folder of up to this many names is sorted in memory (~10 MiB), a larger one here
HALF = 1 << 63  # id hashes are unsigned 64-bit; SQLite stores them shifted into its signed range

SCHEMA = """
CREATE TABLE entries (pos INTEGER PRIMARY KEY, id TEXT NOT NULL, digest BLOB NOT NULL, h INTEGER NOT NULL,
    bytes INTEGER NOT NULL, entry BLOB, sig BLOB);
CREATE TABLE previous (n INTEGER PRIMARY KEY, unit_id TEXT, ids TEXT NOT NULL, inputs TEXT);
CREATE INDEX previous_unit ON previous (unit_id);
CREATE TABLE members (n INTEGER NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, PRIMARY KEY (n, seq))
    WITHOUT ROWID;
CREATE TABLE fresh (rank INTEGER PRIMARY KEY, pos INTEGER NOT NULL, cum INTEGER NOT NULL);
CREATE TABLE names (folder INTEGER NOT NULL, name TEXT NOT NULL, kind INTEGER NOT NULL,
    PRIMARY KEY (folder, name)) WITHOUT ROWID;
CREATE TABLE listed (id TEXT PRIMARY KEY, count INTEGER NOT NULL) WITHOUT ROWID;
"""


Row = tuple[int, str, int, "bytes | None"]  # an entry as groups yield it: (listing position, id, bytes, signature)


def id_digest(entry_id: str) -> bytes:
    """The sha256 of an entry id: its first 8 bytes are the id hash that ranges split on, the whole digest
    orders the new entries of a refresh."""
    return hashlib.sha256(entry_id.encode()).digest()


def chunks(items: Iterable[Any], size: int = CHUNK) -> Iterator[list[Any]]:
    """``items`` in lists of ``size`` (the last one shorter)."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


class Scratch:
    """A scratch SQLite database for one plan: a private temporary file, or memory with ``memory=True``
    (inputs that are in memory already)."""

    def __init__(self, memory: bool = False):
        self.db = sqlite3.connect(":memory:" if memory else "", isolation_level=None)
        for pragma in ("journal_mode = OFF", "synchronous = OFF", "locking_mode = EXCLUSIVE"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.executescript(SCHEMA)
        self.db.execute("BEGIN")
        self._folders = 0
        self._memory: dict[int, tuple[list[tuple[str, int]], set[str]]] = {}  # folder -> its names, its files
        self._indexed = False

    def close(self) -> None:
        if self.db is not None:
            if self.db.in_transaction:
                self.db.execute("COMMIT")  # a rollback without a journal is undefined (the file goes anyway)
            self.db.close()
            self.db = None

    def __enter__(self) -> "Scratch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------------------
    # Listing: a folder's names in order, repeated ids
    # -----------------------------------------------------------------------------------------------------

    def add_folder(self, names: Iterable[tuple[str, int]]) -> int:
        """Keep a folder's ``(name, kind)`` pairs; returns the folder's number for :meth:`folder_names`. Up to
        ``FOLDER_MEMORY`` names are sorted in memory, a larger folder here in the database."""
        self._folders += 1
        it = iter(names)
        head = list(islice(it, FOLDER_MEMORY + 1))
        if len(head) <= FOLDER_MEMORY:
            head.sort()  # (names are unique in a folder: by name)
            self._memory[self._folders] = (head, {name for name, kind in head if kind != FOLDER})
            return self._folders
        for chunk in chunks(chain(head, it)):
            self.db.executemany("INSERT OR REPLACE INTO names VALUES (?, ?, ?)",
                                ((self._folders, name, kind) for name, kind in chunk))
        return self._folders

    def folder_names(self, folder: int, page: int = CHUNK // 2) -> Iterator[list[tuple[str, int]]]:
        """A folder's ``(name, kind)`` pairs in sorted order, a page at a time. Pages are read by key, not
        from an open statement, so the caller may list other folders between two pages."""
        if folder in self._memory:
            names = self._memory[folder][0]
            yield from (names[i:i + page] for i in range(0, len(names), page))
            return
        after = ""  # sorts before every name; a range on the key, so each page is a seek, not a scan
        while True:
            rows = self.db.execute("SELECT name, kind FROM names WHERE folder = ? AND name > ? ORDER BY name LIMIT ?",
                                   (folder, after, page)).fetchall()
            if not rows:
                return
            yield rows
            after = rows[-1][0]

    def files_among(self, folder: int, names: list[str]) -> set[str]:
        """Which of ``names`` are files (or links to files) of ``folder``."""
        if folder in self._memory:
            files = self._memory[folder][1]
            return {name for name in names if name in files}
        found: set[str] = set()
        for chunk in chunks(names):
            found.update(row[0] for row in self.db.execute(
                f"SELECT name FROM names WHERE folder = ? AND kind != {FOLDER} AND name IN "
                f"({','.join('?' * len(chunk))})", (folder, *chunk)))
        return found

    def drop_folder(self, folder: int) -> None:
        if self._memory.pop(folder, None) is None:
            self.db.execute("DELETE FROM names WHERE folder = ?", (folder,))

    def count_listed(self, ids: list[str]) -> dict[str, int]:
        """How often each of ``ids`` was listed before (absent: never); :meth:`set_listed` stores new counts."""
        counts: dict[str, int] = {}
        for chunk in chunks(sorted(set(ids))):
            counts.update(self.db.execute(f"SELECT id, count FROM listed WHERE id IN ({','.join('?' * len(chunk))})",
                                          chunk).fetchall())
        return counts

    def set_listed(self, counts: dict[str, int]) -> None:
        self.db.executemany("INSERT OR REPLACE INTO listed VALUES (?, ?)", counts.items())

    # -----------------------------------------------------------------------------------------------------
    # Entries and the last run's groups
    # -----------------------------------------------------------------------------------------------------

    def add_entries(self, rows: Iterable[tuple[str, int, bytes | None, bytes | None]]) -> int:
        """Append ``(id, estimated bytes, the entry as the caller packs it, its metadata signature)`` rows in
        listing order; returns the count."""
        count = self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        for chunk in chunks(rows):
            values = []
            for entry_id, size, packed, sig in chunk:
                digest = id_digest(entry_id)
                values.append((count, entry_id, digest, int.from_bytes(digest[:8], "big") - HALF, size, packed, sig))
                count += 1
            self.db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)", values)
        return count

    def add_previous(self, unit_id: str | None, ids: list[str], inputs: list[str] | None = None) -> None:
        """Append one group of the last run: its unit id, its entry ids in order, their identities."""
        n = self.db.execute("INSERT INTO previous (unit_id, ids, inputs) VALUES (?, ?, ?)",
                            (unit_id, json.dumps(ids), json.dumps(inputs) if inputs is not None else None)).lastrowid
        for chunk in chunks(enumerate(ids)):
            self.db.executemany("INSERT INTO members VALUES (?, ?, ?)", ((n, seq, i) for seq, i in chunk))

    def clear_previous(self) -> None:
        self.db.execute("DELETE FROM previous")
        self.db.execute("DELETE FROM members")

    def previous_unit(self, unit_id: str) -> tuple[list[str], list[str]] | None:
        """``(entry ids, input identities)`` of the last run's unit ``unit_id``, or None."""
        row = self.db.execute("SELECT ids, inputs FROM previous WHERE unit_id = ? ORDER BY n DESC LIMIT 1",
                              (unit_id,)).fetchone()
        return (json.loads(row[0]), json.loads(row[1])) if row and row[1] is not None else None

    def packed_at(self, positions: list[int]) -> dict[int, bytes | None]:
        """``pos -> the entry as packed`` for the listing positions ``positions``."""
        found: dict[int, bytes | None] = {}
        for chunk in chunks(sorted(set(positions))):
            found.update(self.db.execute(
                f"SELECT pos, entry FROM entries WHERE pos IN ({','.join('?' * len(chunk))})", chunk).fetchall())
        return found

    def every_packed(self) -> Iterator[bytes | None]:
        """Every entry as packed, in listing order, a page at a time (read by key, as :meth:`folder_names`)."""
        after = -1
        while rows := self.db.execute("SELECT pos, entry FROM entries WHERE pos > ? ORDER BY pos LIMIT ?",
                                      (after, CHUNK)).fetchall():
            yield from (packed for _, packed in rows)
            after = rows[-1][0]

    def _index(self) -> None:
        """Index the entries' ids once they are all in (built sorted: cheaper than kept up row by row), and
        find the group that places each id of the last run: the first that holds it."""
        if not self._indexed:
            self.db.execute("CREATE INDEX entries_id ON entries (id, pos)")
            self.db.execute("CREATE TABLE first AS SELECT id, MIN(n) AS n FROM members GROUP BY id")
            self.db.execute("CREATE UNIQUE INDEX first_id ON first (id, n)")
            self._indexed = True

    # -----------------------------------------------------------------------------------------------------
    # The grouping rule
    # -----------------------------------------------------------------------------------------------------

    def groups(self, max_size: int, target: int | None = None) -> Iterator[list[Row]]:
        """The entries of each work unit, one unit at a time, as ``(listing position, id, estimated bytes,
        metadata signature)`` rows: at most ``max_size`` entries and, with ``target``, at most ``target``
        estimated bytes (one larger entry: a unit alone).

        Each group of the last run (:meth:`add_previous`) keeps its entries still listed, in its order (an
        entry listed twice: its last listing; an id an earlier group took: skipped). The entries left over go
        into new groups: by the sha256 of their ids, split evenly by count into the fewest pieces that keep
        both limits. Without any kept group, every entry is grouped by id-hash ranges (:meth:`_ranges`).
        """
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self._index()
        kept, n = False, 0
        while True:
            row = self.db.execute("SELECT n FROM previous WHERE n > ? ORDER BY n LIMIT 1", (n,)).fetchone()
            if row is None:
                break
            n = row[0]
            members = self._place(n)
            if members:
                kept = True
                yield members
        if not kept:  # (the hash index serves the ranges alone, which a refresh that keeps groups never cuts)
            self.db.execute("CREATE INDEX IF NOT EXISTS entries_h ON entries (h, pos, bytes)")
            yield from self._ranges(0, 64, max_size, target)
        else:
            yield from self._pieces(max_size, target)

    def _place(self, group: int) -> list[Row]:
        """The rows of the last run's group ``group``: its ids, in its order, that are listed (an id listed
        twice: its last listing) and that no earlier group holds."""
        return self.db.execute(
            "SELECT e.pos, e.id, e.bytes, e.sig FROM members m JOIN first f ON f.id = m.id AND f.n = m.n "
            "JOIN entries e ON e.pos = (SELECT MAX(l.pos) FROM entries l WHERE l.id = m.id) "
            "WHERE m.n = ? ORDER BY m.seq", (group,)).fetchall()

    def _ranges(self, lo: int, bits: int, max_size: int, target: int | None) -> Iterator[list[int]]:
        """The id-hash range ``[lo, lo + 2**bits)``, halved while it holds more than ``max_size`` entries or
        more than ``target`` bytes (a single entry excepted); groups in ascending hash order, each ordered by
        hash, then listing position. Adding an entry changes only the range it falls into."""
        low = lo - HALF
        high = low + (1 << bits) - 1
        count, total = self.db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM entries "
                                       "WHERE h BETWEEN ? AND ?", (low, high)).fetchone()
        if not count:
            return
        too_big = count > max_size or (target is not None and count > 1 and total > target)
        if not too_big or bits == 0:
            yield self.db.execute("SELECT pos, id, bytes, sig FROM entries WHERE h BETWEEN ? AND ? ORDER BY h, pos",
                                  (low, high)).fetchall()
            return
        mid = lo + (1 << (bits - 1))
        yield from self._ranges(lo, bits - 1, max_size, target)
        yield from self._ranges(mid, bits - 1, max_size, target)

    def _pieces(self, max_size: int, target: int | None) -> Iterator[list[int]]:
        """The entries no group placed, ordered by the sha256 of their ids (then listing position), cut into
        ``count`` even pieces: the fewest by count and by bytes, one more while a piece of several entries is
        over ``target``. When there are more pieces than entries some are empty, and are groups still."""
        self.db.execute("DELETE FROM fresh")
        self.db.execute("INSERT INTO fresh SELECT ROW_NUMBER() OVER w, pos, SUM(bytes) OVER w FROM entries e "
                        "WHERE NOT EXISTS (SELECT 1 FROM first f WHERE f.id = e.id) "
                        "WINDOW w AS (ORDER BY digest, pos ROWS UNBOUNDED PRECEDING)")
        size, total = self.db.execute("SELECT COUNT(*), COALESCE(MAX(cum), 0) FROM fresh").fetchone()
        if not size:
            return

        def cum(rank: int) -> int:  # the bytes of the first ``rank`` new entries
            return self.db.execute("SELECT cum FROM fresh WHERE rank = ?", (rank,)).fetchone()[0] if rank else 0

        def fits(start: int, end: int) -> bool:
            return end - start == 1 or cum(end) - cum(start) <= target

        count = -(-size // max_size)
        if target is not None:
            count = max(count, -(-total // target))
        while target is not None and count < size and not all(
                fits(k * size // count, (k + 1) * size // count) for k in range(count)):
            count += 1  # uneven sizes: one piece more until every piece fits
        for k in range(count):
            yield self.db.execute("SELECT e.pos, e.id, e.bytes, e.sig FROM fresh f JOIN entries e ON e.pos = f.pos "
                                  "WHERE f.rank > ? AND f.rank <= ? ORDER BY f.rank",
                                  (k * size // count, (k + 1) * size // count)).fetchall()
