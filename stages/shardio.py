"""Shard I/O shared by every stage: deterministic webdataset tars, atomic commits, unit records, manifests.

Layout of one stage under ``<output_dir>/prep/<stage>/``::

    shards/<stage>-<unit id>-<part>.tar   webdataset tars, written as .tmp and renamed when complete
    units/<unit id>.json                  what one work unit produced (shards, quarantine), written last
    manifest.json                         the stage's current output: every shard, counts, fingerprint
    quarantine.jsonl                      every sample the stage refused, with the reason

A work unit's id is the hash of its inputs' content and the stage fingerprint (contract 1), so a unit
whose record exists is done: re-running reuses it, and a killed run resumes at the first missing unit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import sys
import tarfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import webdataset as wds

FORMAT_VERSION = 1
_TAR_USER = "latentmill"


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


class FileHashes:
    """sha256 of local files, remembered by ``(size, mtime_ns, inode)`` across runs in a SQLite file.

    A refresh lists every input again; without this it re-reads every byte to find that nothing changed.
    A remembered digest is used only while the file's size, mtime and inode are what they were when it
    was hashed. Like git's index, a file hashed within ``RACY_SECONDS`` of its last modification is not
    remembered (a second write in the same mtime tick could keep the stat and change the bytes).

    The store is looked up a file at a time (nothing is loaded whole: a million files cost no memory) and
    written by ``save``; several processes may share one (SQLite locks it). A missing, locked or damaged
    store only means hashing again. Thread-safe.
    """

    RACY_SECONDS = 2.0

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._db = None
        self._new: dict[str, tuple[int, int, int, str]] = {}  # hashed by this instance, to remember
        self._seen: set[str] = set()  # every file asked for (what ``save`` keeps when forgetting)
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
            return db
        except sqlite3.Error:
            return None

    def _known(self, key: str) -> tuple | None:
        import sqlite3

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
        if known is not None and tuple(known[:3]) == stat:
            return known[3]
        digest = sha256_file(key)
        with self._lock:
            self.hashed += 1
            if time.time() - st.st_mtime_ns / 1e9 >= self.RACY_SECONDS:
                self._new[key] = (*stat, digest)
        return digest

    def save(self, forget_unused: bool = True) -> None:
        """Remember the digests hashed since opening; with ``forget_unused`` also forget the files this
        instance was not asked for (a dataset's own store), without it keep them (a shared store)."""
        import sqlite3

        if self.path is None or (not self._new and not forget_unused):
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._db is None:
                self._db = self._connect()
            if self._db is None:
                return
            with self._lock:
                rows = [(k, *v) for k, v in sorted(self._new.items())]
                db = self._db
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)", rows)
                    if forget_unused:
                        db.execute("CREATE TEMP TABLE IF NOT EXISTS seen (path TEXT PRIMARY KEY)")
                        db.execute("DELETE FROM seen")
                        db.executemany("INSERT OR IGNORE INTO seen VALUES (?)", ((k,) for k in self._seen))
                        db.execute("DELETE FROM files WHERE path NOT IN (SELECT path FROM seen)")
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                self._new.clear()
        except (sqlite3.Error, OSError):
            pass  # a read-only or busy store: the digests are only remembered for this process

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


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
TRIM_EVERY_UNITS = 8  # ...at most once every this many units of the process
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
    ``TRIM_FREE_BYTES`` free. Trimming bounds the creep of fragmented free memory, but it is not free: the
    next unit faults its pages back in (trimming after every unit cost ~10% of a small CPU cache stage).
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


def stable_hash(obj: Any) -> str:
    """Hash of a JSON-able object, independent of dict order."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def json_bytes(obj: Any) -> bytes:
    """Canonical JSON encoding used for every metadata member and record."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def meta_bytes(meta: dict[str, Any]) -> bytes:
    """A sample's ``json`` member: canonical JSON without null fields (an absent field reads as None).

    Hugging Face ``datasets`` types each field from a shard's first samples: a field that is null there and
    a string later fails to load, one that is absent there is only left out.
    """
    return json_bytes(_without_nulls(meta))


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(json.dumps(obj, sort_keys=True, indent=1).encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# Reading and writing one shard
# ---------------------------------------------------------------------------------------------------------


class _HashingFile:
    """A write-only file that hashes what passes through it (the shard is not read back to hash it)."""

    def __init__(self, fh):
        self.fh = fh
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


class _ShardSink:
    """Writes samples into ``path`` through a temporary file; ``commit`` renames it into place."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self._fh = open(self.tmp, "wb")
        self._hashing = _HashingFile(self._fh)
        # mtime 0 and fixed owner make the tar bytes a pure function of the samples; the tar is a stream
        # ("w|"), written front to back, so hashing the writes hashes the file.
        self._writer = wds.TarWriter(self._hashing, user=_TAR_USER, group=_TAR_USER, mtime=0, encoder=False,
                                     compress=False)
        self.count = 0

    def write(self, sample: dict[str, Any]) -> None:
        self._writer.write(sample)
        self.count += 1

    def commit(self) -> str:
        self._writer.close()  # ends the tar stream; the file object stays ours
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self.tmp, self.path)
        return self._hashing.sha.hexdigest()

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self._fh.close()
            self.tmp.unlink(missing_ok=True)


def read_shard(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the samples of a webdataset tar as ``{"__key__": key, ext: bytes, ...}``, in file order."""
    current: dict[str, Any] | None = None
    with tarfile.open(path, "r") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = os.path.basename(member.name)
            if "." not in base:
                continue
            prefix, ext = base.split(".", 1)
            key = os.path.join(os.path.dirname(member.name), prefix)
            data = tar.extractfile(member).read()
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key}
            current[ext] = data
    if current is not None:
        yield current


# ---------------------------------------------------------------------------------------------------------
# Work units
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ShardInfo:
    """One committed output shard."""

    name: str
    path: str  # relative to the stage directory
    sha256: str
    samples: int
    bucket: list[int] | None = None


@dataclass
class UnitRecord:
    """What one work unit produced; its presence on disk means the unit is done."""

    unit_id: str
    stage: str
    inputs: list[str]
    shards: list[ShardInfo]
    quarantined: list[dict[str, Any]]
    samples_in: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    reused: bool = False

    @property
    def samples_out(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("reused")
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "UnitRecord":
        data = dict(data)
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        return cls(**data)


@dataclass
class WorkUnit:
    """A stage's unit of work: its id (content hash + fingerprint) and what it reads."""

    unit_id: str
    inputs: list[str]  # input identities (content hashes), for the record
    payload: dict[str, Any]  # stage-specific description: input shard paths, file lists, bucket...
    samples_in: int


class UnitOutput:
    """Collects one unit's samples into shards (one per ``part``) and its quarantine entries."""

    def __init__(self, stage_dir: "StageDir", unit: WorkUnit):
        self.stage_dir = stage_dir
        self.unit = unit
        self._sinks: dict[str, _ShardSink] = {}
        self._buckets: dict[str, list[int] | None] = {}
        self.quarantined: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}

    def add(self, sample: dict[str, Any], part: str = "0", bucket: list[int] | None = None) -> None:
        """Append ``sample`` to the shard ``part`` of this unit (e.g. one part per bucket)."""
        sink = self._sinks.get(part)
        if sink is None:
            name = f"{self.stage_dir.stage}-{self.unit.unit_id[:16]}-{part}.tar"
            sink = self._sinks[part] = _ShardSink(self.stage_dir.shard_dir / name)
            self._buckets[part] = bucket
        sink.write(sample)

    def quarantine(self, key: str, source: str, reason: str) -> None:
        """Refuse one sample, keeping where it came from and why."""
        self.quarantined.append({"key": key, "source": source, "stage": self.stage_dir.stage, "reason": reason})

    def commit(self, seconds: float) -> UnitRecord:
        shards = []
        for part in sorted(self._sinks):
            sink = self._sinks[part]
            digest = sink.commit()
            shards.append(
                ShardInfo(
                    name=sink.path.name,
                    path=f"shards/{sink.path.name}",
                    sha256=digest,
                    samples=sink.count,
                    bucket=self._buckets[part],
                )
            )
        record = UnitRecord(
            unit_id=self.unit.unit_id,
            stage=self.stage_dir.stage,
            inputs=self.unit.inputs,
            shards=shards,
            quarantined=self.quarantined,
            samples_in=self.unit.samples_in,
            seconds=round(seconds, 4),
            extra=self.extra,
        )
        _write_json_atomic(self.stage_dir.unit_path(self.unit.unit_id), record.to_json())
        return record

    def abort(self) -> None:
        for sink in self._sinks.values():
            sink.abort()


class StageDir:
    """The directory of one stage: shards, unit records, manifest and quarantine list."""

    def __init__(self, root: str | Path, stage: str):
        self.stage = stage
        self.root = Path(root)
        self.shard_dir = self.root / "shards"
        self.unit_dir = self.root / "units"
        self.manifest_path = self.root / "manifest.json"
        self.quarantine_path = self.root / "quarantine.jsonl"

    def ensure(self) -> "StageDir":
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        return self

    def unit_path(self, unit_id: str) -> Path:
        return self.unit_dir / f"{unit_id}.json"

    def load_record(self, unit_id: str) -> UnitRecord | None:
        """The unit's record if the unit is complete (record present and every shard on disk)."""
        path = self.unit_path(unit_id)
        if not path.is_file():
            return None
        try:
            record = UnitRecord.from_json(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            return None
        if any(not (self.root / s.path).is_file() for s in record.shards):
            return None
        record.reused = True
        return record

    def run_unit(self, unit: WorkUnit, process: Callable[[WorkUnit, UnitOutput], None]) -> UnitRecord:
        """Run ``process`` on ``unit`` unless an identical unit already committed; return its record."""
        record = self.load_record(unit.unit_id)
        if record is not None:
            return record
        self.ensure()
        out = UnitOutput(self, unit)
        start = time.perf_counter()
        try:
            process(unit, out)
        except BaseException:
            out.abort()
            raise
        finally:
            release_memory()
        return out.commit(time.perf_counter() - start)

    def write_manifest(self, records: list[UnitRecord], header: dict[str, Any]) -> dict[str, Any]:
        """Write the stage manifest (last, atomically) and the quarantine list; return the manifest."""
        self.ensure()
        records = sorted(records, key=lambda r: r.unit_id)
        shards = [asdict(s) for r in records for s in r.shards]
        quarantined = [q for r in records for q in r.quarantined]
        expanded = sum(int(r.extra.get("expanded", 0)) for r in records)
        manifest = {
            "stage": self.stage,
            "format_version": FORMAT_VERSION,
            **header,
            "shards": sorted(shards, key=lambda s: s["name"]),
            "units": [r.unit_id for r in records],
            "counts": {
                "in": sum(r.samples_in for r in records),
                "out": sum(r.samples_out for r in records),
                "quarantined": len(quarantined),
                **({"expanded": expanded} if expanded else {}),  # clips beyond one per video
            },
        }
        tmp = self.quarantine_path.with_name(self.quarantine_path.name + ".tmp")
        with open(tmp, "wb") as fh:
            for q in sorted(quarantined, key=lambda q: (q["source"], q["key"])):
                fh.write(json_bytes(q) + b"\n")
        os.replace(tmp, self.quarantine_path)
        _write_json_atomic(self.manifest_path, manifest)
        return manifest

    def read_manifest(self) -> dict[str, Any]:
        if not self.manifest_path.is_file():
            raise FileNotFoundError(f"{self.manifest_path} does not exist: run the {self.stage} stage first")
        return json.loads(self.manifest_path.read_text())


def stage_report(stage: str, records: list[UnitRecord], seconds: float) -> dict[str, Any]:
    """Counts for the run summary: in + expanded = out + quarantined, and in = processed + reused.

    ``expanded`` is non-zero only where one input sample becomes several outputs (the bucket stage cuts a
    video into clips); its records then count ``videos``, ``clips`` and ``expanded`` (clips beyond the
    first of each video) in ``extra``, and the report carries them. ``in``, ``processed`` and ``reused``
    count input samples; ``out`` counts output samples (clips).
    """
    report = {
        "in": sum(r.samples_in for r in records),
        "out": sum(r.samples_out for r in records),
        "quarantined": sum(len(r.quarantined) for r in records),
        "processed": sum(r.samples_in for r in records if not r.reused),
        "reused": sum(r.samples_in for r in records if r.reused),
        "shards": sum(len(r.shards) for r in records),
        "units": len(records),
        "seconds": round(seconds, 3),
    }
    expanded = sum(int(r.extra.get("expanded", 0)) for r in records)
    if any("clips" in r.extra for r in records):
        report["videos"] = sum(int(r.extra.get("videos", 0)) for r in records)
        report["clips"] = sum(int(r.extra.get("clips", 0)) for r in records)
        report["expanded"] = expanded
    if report["in"] + expanded != report["out"] + report["quarantined"]:
        raise RuntimeError(f"{stage}: counts do not conserve: {report}")
    return report


def sample_json(sample: dict[str, Any]) -> dict[str, Any]:
    """Decode a sample's ``json`` member."""
    return json.loads(sample["json"])


def iter_samples(stage_root: Path, shards: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Yield every sample of the listed shards (manifest entries), in order."""
    for shard in shards:
        yield from read_shard(stage_root / shard["path"])


def units_per_shard(upstream: StageDir, fingerprint: dict[str, Any]) -> list[WorkUnit]:
    """One work unit per upstream shard, keyed by that shard's hash and this stage's fingerprint."""
    units = []
    for shard in upstream.read_manifest()["shards"]:
        unit_id = stable_hash({"fingerprint": fingerprint, "inputs": [shard["sha256"]]})
        payload = {"shard": str(upstream.root / shard["path"]), "bucket": shard.get("bucket")}
        units.append(WorkUnit(unit_id, [shard["sha256"]], payload, shard["samples"]))
    return units
