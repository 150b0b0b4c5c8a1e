"""One catalog per output folder: the keys the stages look up, in SQLite (``<output_dir>/prep/catalog.sqlite``).

What the stages reuse across units and runs lives here rather than in each process's memory:

* ``scores``: a curate score key -> its value (by each unit that holds it);
* ``embeddings``: a near-duplicate embedding key -> (the unit whose ``.npy`` file holds it, its row);
* ``components``: a cache component key (``vae`` or ``text``) -> every committed unit that holds it, with the
  sample and member it is in and where it was encoded;
* ``plans``: the work units a stage planned, so that task runs carry unit ids rather than payloads.

The unit records (``units/<id>.json``) stay the source of truth, with the per-sample facts a record names
in its detail file (:func:`unit_detail`: a curate unit's score rows, a cache unit's component keys), kept
out of the record so that reading a stage's records costs per unit, not per sample. A unit's rows are
written in its commit, right after its record (:meth:`Catalog.enter`). :meth:`Catalog.sync` brings a
stage's rows in line with its records: it enters a record the catalog lacks (a run killed between the two
writes, a catalog deleted or written before this module existed) and forgets units whose record is gone
(gc). Every reader syncs first, so a lookup never depends on which process committed what.

One connection per call, no connection kept: the catalog is shared by threads, worker processes and
machines that see the same output folder, and SQLite's file locks order their writes (rollback journal,
not WAL, which needs shared memory that a network filesystem does not give).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Iterator

from latentmill.stages.remotetars import held

FILE = "catalog.sqlite"
DETAIL_KEY = "detail"  # a record's ``extra`` field naming its detail file, relative to the stage folder
SCHEMA_VERSION = 1
KINDS = {"vae": 0, "text": 1}  # a component's table, as stored
BUSY_TIMEOUT_S = 120  # how long a writer waits for another's transaction before failing

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('schema', '{SCHEMA_VERSION}');
CREATE TABLE IF NOT EXISTS units (
    id INTEGER PRIMARY KEY, stage TEXT NOT NULL, unit_id TEXT NOT NULL, committed_ns INTEGER NOT NULL,
    shards TEXT NOT NULL, device TEXT, embeddings TEXT, UNIQUE (stage, unit_id));
CREATE TABLE IF NOT EXISTS scores (key BLOB NOT NULL, unit INTEGER NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (key, unit)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS scores_unit ON scores (unit);
CREATE TABLE IF NOT EXISTS embeddings (key BLOB PRIMARY KEY, unit INTEGER NOT NULL, row INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS components (
    kind INTEGER NOT NULL, key BLOB NOT NULL, unit INTEGER NOT NULL, sample TEXT NOT NULL, member INTEGER NOT NULL,
    device TEXT, PRIMARY KEY (kind, key, unit)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS components_unit ON components (unit);
CREATE TABLE IF NOT EXISTS plans (stage TEXT NOT NULL, unit_id TEXT NOT NULL, unit TEXT NOT NULL,
    PRIMARY KEY (stage, unit_id)) WITHOUT ROWID;
"""


def raw_key(key: str) -> bytes | None:
    """The 32 bytes of a sha256 hex key, or None for anything else (such a key is never stored)."""
    if not isinstance(key, str) or len(key) != 64:
        return None
    try:
        return bytes.fromhex(key)
    except ValueError:
        return None


def unit_detail(stage_root: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """The per-sample facts of a unit whose record's ``extra`` is ``extra``: its detail file (a JSON object
    beside its shards), or ``extra`` itself for a unit committed before detail files (its record held
    them)."""
    name = extra.get(DETAIL_KEY)
    return json.loads((Path(stage_root) / name).read_text()) if name else extra


def catalog_path(stage_root: Path) -> Path:
    """The catalog of the output folder that holds the stage folder ``stage_root`` (``prep/<stage>``)."""
    return Path(stage_root).parent / FILE


class Catalog:
    """The catalog beside the stage folders of one prep (``prep/catalog.sqlite``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._ready = False  # the schema was made (or found) by this object

    @contextlib.contextmanager
    def _db(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        """A connection for one call; ``write``: inside one transaction, taken before any read."""
        if not self._ready:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            if not self._ready:
                self._make_schema(db)
                self._ready = True
            if not write:
                yield db
                return
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()

    @staticmethod
    def _make_schema(db: sqlite3.Connection) -> None:
        """The tables, made where missing; a catalog of another schema version is emptied first (the unit
        records refill it)."""
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        version = (db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchall()
                   if "meta" in tables else [])
        if version and version[0][0] != str(SCHEMA_VERSION):
            db.executescript("BEGIN;" + "".join(f"DROP TABLE IF EXISTS {t};" for t in sorted(tables)) + "COMMIT;")
            tables = set()
        if "plans" not in tables:
            db.executescript(SCHEMA)  # idempotent, in its own transaction

    # -----------------------------------------------------------------------------------------------------
    # Writing: a unit's rows, and bringing a stage in line with its records
    # -----------------------------------------------------------------------------------------------------

    def enter(self, stage: str, record: dict[str, Any], committed_ns: int,
              detail: dict[str, Any] | None = None) -> None:
        """Enter (or enter again) the rows of one committed unit record (as written: its JSON value);
        ``detail``: its per-sample facts when the caller holds them (else read, :func:`unit_detail`)."""
        if detail is None:
            detail = unit_detail(self.path.parent / stage, record.get("extra") or {})
        with self._db(write=True) as db:
            _enter(db, stage, record, committed_ns, detail)

    def sync(self, stage: str, unit_dir: Path) -> int:
        """Enter the stage's committed records (``unit_dir/<unit id>.json``) the catalog lacks and forget the
        units whose record is gone; returns how many records were entered. Costs a listing of ``unit_dir``
        when nothing is missing."""
        on_disk = {e.name[:-5] for e in _scan(unit_dir) if e.name.endswith(".json")}
        with self._db() as db:
            known = {row[0] for row in db.execute("SELECT unit_id FROM units WHERE stage = ?", (stage,))}
        missing, gone = sorted(on_disk - known), sorted(known - on_disk)
        if not missing and not gone:
            return 0
        entered = 0
        with self._db(write=True) as db:
            for unit_id in gone:
                _forget(db, stage, unit_id)
            for unit_id in missing:
                path = Path(unit_dir) / f"{unit_id}.json"
                try:
                    record = json.loads(path.read_text())
                    committed_ns = path.stat().st_mtime_ns
                    detail = unit_detail(Path(unit_dir).parent, record["extra"])
                    _enter(db, stage, record, committed_ns, detail)
                except (OSError, ValueError, TypeError, KeyError, AttributeError):
                    continue  # a damaged record: the unit runs again, and its commit enters it
                entered += 1
        return entered

    # -----------------------------------------------------------------------------------------------------
    # Reading
    # -----------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lookup(self) -> Iterator["Lookup"]:
        """One connection for many lookups (a unit's samples)."""
        with self._db() as db:
            yield Lookup(db)

    # -----------------------------------------------------------------------------------------------------
    # Plans: task runs carry unit ids
    # -----------------------------------------------------------------------------------------------------

    def put_plan(self, stage: str, units: Iterable[tuple[str, str]], replace: bool = True) -> None:
        """Store a stage's planned units, ``(unit id, its JSON text)`` each, replacing its earlier plan; with
        ``replace=False`` adding to it (a plan stored a batch at a time as it streams)."""
        with self._db(write=True) as db:
            if replace:
                db.execute("DELETE FROM plans WHERE stage = ?", (stage,))
            db.executemany("INSERT OR REPLACE INTO plans VALUES (?, ?, ?)", ((stage, i, t) for i, t in units))

    def planned(self, stage: str, unit_ids: list[str]) -> list[Any]:
        """The stored JSON values of the planned units ``unit_ids``, in that order."""
        found = []
        with self._db() as db:
            for unit_id in unit_ids:
                rows = db.execute("SELECT unit FROM plans WHERE stage = ? AND unit_id = ?", (stage, unit_id)).fetchall()
                if not rows:
                    raise KeyError(f"{self.path}: no planned {stage} unit {unit_id}")
                found.append(json.loads(rows[0][0]))
        return found


class Lookup:
    """Lookups over one open connection of the catalog (:meth:`Catalog.lookup`). Every query is read to its
    end (``fetchall``): a statement left open would hold the file's shared lock and keep writers waiting."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db
        self._on_disk: dict[Path, bool] = {}

    def score(self, key: str) -> float | None:
        """The stored value of score ``key``, or None."""
        raw = raw_key(key)
        rows = self._db.execute("SELECT value FROM scores WHERE key = ? LIMIT 1", (raw,)).fetchall() if raw else ()
        return float(rows[0][0]) if rows else None

    def embedding(self, key: str) -> tuple[str, int] | None:
        """(``.npy`` file relative to the curate folder, row) of embedding ``key``, or None."""
        raw = raw_key(key)
        rows = self._db.execute("SELECT u.embeddings, e.row FROM embeddings e JOIN units u ON u.id = e.unit "
                                "WHERE e.key = ?", (raw,)).fetchall() if raw else ()
        return (rows[0][0], int(rows[0][1])) if rows and rows[0][0] else None

    def component(self, stage_root: Path, kind: str, key: str,
                  before_ns: int) -> tuple[tuple[Path, ...], str, int, str | None] | None:
        """(shards, sample key, member, device) of component ``key`` of ``kind`` (``vae``, ``text``), from the
        oldest unit committed before ``before_ns`` whose shards are all still on disk; None without one. A
        unit committed later is never used (see ``stages.cache.plan``). ``member``: 0 the latent, j + 1 the
        j-th caption's embedding; ``device``: where it was encoded, None when unknown."""
        raw = raw_key(key)
        if raw is None:
            return None
        rows = self._db.execute(
            "SELECT u.committed_ns, u.shards, c.sample, c.member, COALESCE(c.device, u.device) "
            "FROM components c JOIN units u ON u.id = c.unit WHERE c.kind = ? AND c.key = ? "
            "ORDER BY u.committed_ns, u.id", (KINDS[kind], raw)).fetchall()
        for committed, shards, sample, member, device in rows:
            if committed >= before_ns:
                return None
            paths = tuple(Path(stage_root) / p for p in json.loads(shards))
            if paths and all(self._exists(p) for p in paths):
                return paths, sample, int(member), device
        return None

    def _exists(self, path: Path) -> bool:
        if path not in self._on_disk:
            self._on_disk[path] = held(path)  # or on the store, read from there when used
        return self._on_disk[path]


def _scan(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _forget(db: sqlite3.Connection, stage: str, unit_id: str) -> None:
    row = db.execute("SELECT id FROM units WHERE stage = ? AND unit_id = ?", (stage, unit_id)).fetchone()
    if row is None:
        return
    db.execute("DELETE FROM scores WHERE unit = ?", row)
    db.execute("DELETE FROM components WHERE unit = ?", row)
    db.execute("DELETE FROM embeddings WHERE unit = ?", row)
    db.execute("DELETE FROM units WHERE id = ?", row)


def _enter(db: sqlite3.Connection, stage: str, record: dict[str, Any], committed_ns: int,
           detail: dict[str, Any]) -> None:
    """The rows of one record: its unit, and what its stage keeps (curate: scores and embeddings; cache:
    components), the per-sample ones from ``detail``."""
    _forget(db, stage, record["unit_id"])
    extra = record.get("extra") or {}
    device = extra.get("device") if stage == "cache" else None  # the cache's device class (a captioner's is text)
    device = device.get("key") if isinstance(device, dict) else None
    emb = (extra.get("embeddings") or None) if stage == "curate" else None
    cur = db.execute("INSERT INTO units (stage, unit_id, committed_ns, shards, device, embeddings) "
                     "VALUES (?, ?, ?, ?, ?, ?)",
                     (stage, record["unit_id"], committed_ns, json.dumps([s["path"] for s in record["shards"]]),
                      device, emb["file"] if emb else None))
    unit = cur.lastrowid
    scores = (detail.get("scores") or {}) if stage == "curate" else {}
    db.executemany("INSERT OR REPLACE INTO scores VALUES (?, ?, ?)", (
        (raw, unit, float(row["values"][name])) for row in scores.values()
        for name, key in (row.get("keys") or {}).items()
        if name in (row.get("values") or {}) and (raw := raw_key(key)) is not None))
    if emb:
        db.executemany("INSERT OR REPLACE INTO embeddings VALUES (?, ?, ?)", (
            (raw, unit, n) for n, key in enumerate(emb.get("ekeys") or ()) if (raw := raw_key(key)) is not None))
    foreign = extra.get("foreign") or {}
    rows = []
    for sample, keys in ((detail.get("components") or {}) if stage == "cache" else {}).items():
        texts = keys["text"] if isinstance(keys["text"], list) else [keys["text"]]
        for kind, key, member in [("vae", keys["vae"], 0), *(("text", tk, j + 1) for j, tk in enumerate(texts))]:
            raw = raw_key(key)
            if raw is not None:
                rows.append((KINDS[kind], raw, unit, sample, member, foreign.get(key)))
    # one row per (key, unit): a caption shared by many samples of the unit keeps its first sample
    db.executemany("INSERT OR IGNORE INTO components VALUES (?, ?, ?, ?, ?, ?)", rows)
