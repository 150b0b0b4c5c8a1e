"""An ``output_dir`` on an object store: the local work folder, publishing to the store, the writer lease.

A prep on ``s3://bucket/x`` runs the local code unchanged in a work folder of this machine
(``latentmill.core.store.work_dir_for``), between two copies (docs/object-stores.md):

* :func:`pull` brings the store's output into the work folder (what the folder lacks, through temporary names),
  so the units the store holds are reused; the SQLite catalog and the input digests stay local and are
  rebuilt from the records.
* :func:`push` publishes the work folder in an order a reader can trust without renames: every shard, index
  and detail file, then the unit records, then the stage manifests and quarantine lists, then the snapshot
  manifests, and ``snapshots/LATEST`` last.
* :class:`UnitPublisher` publishes each unit the prep commits while it runs (parts, then record).
* :func:`gc_store`, :func:`compact_store`, :func:`verify_store` and :func:`local_view`: ``gc``, ``compact``,
  ``verify`` and ``inspect`` there.
* :func:`store_lease` is the writer lock on a store: one object written only if absent (``If-None-Match``;
  GCS: ``ifGenerationMatch=0``), renewed while its holder lives (``If-Match`` its ETag, on S3 and Azure Blob;
  GCS: its generation), taken over once its lease has run out. A training holds a lease of the same kind,
  ``.train.lock`` (:func:`training_lease`): one training writes an output's runs at a time.
* Pins: a user's pin is an object ``pins/<snapshot>.pin`` (:func:`pin_store`, :func:`unpin_store`); a training
  run's is a lease of its own, ``pins/<snapshot>@<host>-<pid>.pin`` (:func:`pinned_on_store`), which lapses
  when its holder dies. :func:`gc_store` keeps what the live pins name (:func:`store_pins`).
"""

from __future__ import annotations

import abc
import base64
import hashlib
import json
import os
import posixpath
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Collection, Iterator, Literal

from latentmill.pipelines.retention import (
    LOCK_FILE,
    PINS,
    TRAIN_LOCK,
    OutputBusyError,
    busy_message,
    holder_kind,
    holder_line,
    holder_of,
    pin_record,
)
from latentmill.pipelines.snapshot import LATEST
from latentmill.stages import remotetars
from latentmill.stages.catalog import DETAIL_KEY
from latentmill.stages.killpoint import KillPoint

from latentmill.core.config import ConfigError
from latentmill.core.hashing import md5_file
from latentmill.core.store import join, store_fs, work_dir_for

LOCAL_SUFFIXES = (".sqlite", ".sqlite-wal", ".sqlite-shm", ".sqlite-journal", ".tmp")  # catalog, digests
LOCAL_NAMES = {"last-run.json"}  # the unchanged check's memory: stat signatures of this machine's files
# The stores whose conditional writes leases use, with the field of ``info()`` that names an object's version
# there: S3's ETag (If-None-Match, If-Match), GCS's generation (ifGenerationMatch), Azure Blob's etag
# (If-None-Match, If-Match; adlfs gives az://, abfs:// and abfss:// one filesystem).
LEASE_TOKENS = {"s3://": "ETag", "s3a://": "ETag", "gs://": "generation", "gcs://": "generation",
                "az://": "etag", "abfs://": "etag", "abfss://": "etag"}
LEASE_SCHEMES = tuple(LEASE_TOKENS)
NO_LEASE = ("needs conditional writes (If-None-Match and If-Match, or GCS's ifGenerationMatch): s3://, gs:// and "
            "az:// have them")
LEASE_S = 60.0  # a writer lease: renewed every third of it; a holder silent for this long is taken to be dead
PULLING = remotetars.PULLING  # suffix of a file being downloaded: renamed into place once whole
PUBLISH_EVERY_S = 10.0  # how often a running prep publishes the units it committed
CACHE = "prep/cache/"  # the cache stage's folder, the one compaction merges
PAUSE_ENV = "LATENTMILL_PUBLISH_PAUSE_AFTER"  # tests: pause after this many publishing rounds, for a kill


def shared(rel: str) -> bool:
    """Whether the work folder's file ``rel`` (a ``/`` path) belongs on the store: not the local catalog,
    digest stores, locks, pins, temporaries or training runs."""
    parts = rel.split("/")
    name = parts[-1]
    return (parts[0] in ("prep", "snapshots") and not name.startswith(".") and not name.endswith(LOCAL_SUFFIXES)
            and name not in LOCAL_NAMES)


def phase(rel: str) -> int:
    """The order in which ``rel`` is published: parts (0), unit records (1), stage manifests and the other
    prep files (2), snapshot manifests (3), the ``LATEST`` pointer (4)."""
    parts = rel.split("/")
    if rel == f"snapshots/{LATEST}":
        return 4
    if parts[0] == "snapshots":
        return 3
    if len(parts) >= 4 and parts[0] == "prep" and parts[2] == "units":
        return 1
    if len(parts) >= 4 and parts[0] == "prep" and parts[2] == "shards":
        return 0
    return 2


def _stored_md5(info: dict[str, Any]) -> str:
    """The MD5 (hex) a store gives of an object, "" where it gives none: S3's ETag of a single-part upload,
    GCS's ``md5Hash``, Azure's Content-MD5 (set by a single-shot upload). GCS's and Azure's ETags are no MD5."""
    if info.get("md5Hash"):
        return base64.b64decode(info["md5Hash"]).hex()
    if info.get("content_settings") is not None:
        md5 = info["content_settings"].get("content_md5")
        return bytes(md5).hex() if md5 else ""
    etag = str(info.get("ETag") or "").strip('"')
    return "" if "-" in etag else etag  # a multipart upload's ETag is no MD5


def _same(local: Path, info: dict[str, Any], rel: str) -> bool:
    """Whether the local file holds the store object's bytes: by size for shards (content-addressed names),
    else by the object's MD5 where the store gives one (:func:`_stored_md5`)."""
    size = local.stat().st_size
    if size != int(info.get("size") or 0):
        return False
    md5 = _stored_md5(info)
    if phase(rel) == 0 or not md5:
        return True
    return md5_file(local) == md5


def store_listing(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """Every object below ``root``, by its ``/`` path relative to it (one listing request per 1,000)."""
    try:  # a listing request every time: fsspec's cached listings miss what another process wrote
        found = fs.find(root, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    prefix = root.rstrip("/") + "/"
    return {name[len(prefix):]: info for name, info in found.items() if name.startswith(prefix)}


def all_local_files(work: Path) -> Iterator[str]:
    for folder, dirs, files in os.walk(work):
        dirs.sort()
        for name in sorted(files):
            yield Path(os.path.relpath(os.path.join(folder, name), work)).as_posix()


def local_files(work: Path) -> list[str]:
    """The work folder's files that belong on the store (``/`` paths relative to it)."""
    return [rel for rel in all_local_files(work) if shared(rel)]


def pull(url: str, work: Path | None = None, tars: bool | Collection[str] = True,
         list_tars: bool = False) -> dict[str, Any]:
    """Download what the work folder of ``url`` lacks or holds differently (``tars=False``: everything but the
    shards' tars, for reading manifests, records and indexes; a collection of ``/`` paths: only those tars);
    ``{"work_dir", "downloaded", "bytes", "tar_sizes"}``, the last the bytes of every tar on the store by path.
    A downloaded file takes its object's time on the store as its mtime: gc keeps the units committed after the
    newest snapshot by that order, which parallel downloads do not keep. ``list_tars``: list the store's tars in
    the work folder (``latentmill.stages.remotetars``: a stage that reads one the folder lacks downloads it
    then, a unit whose tars are there or on the store is reused, gc plans over them); a listing older than
    the folder's list does not replace it."""
    fs, root = store_fs(url)
    work = work or work_dir_for(url)
    work.mkdir(parents=True, exist_ok=True)
    remote, local, stamps, size, tar_sizes, on_store = [], [], [], 0, {}, {}
    listed_at = time.time()
    for rel, info in sorted(store_listing(fs, root).items()):
        if not shared(rel):
            continue
        if rel.endswith(".tar"):
            tar_sizes[rel] = int(info.get("size") or 0)
            if rel.startswith("prep/"):
                on_store[rel[len("prep/"):]] = {"size": tar_sizes[rel], "md5": _stored_md5(info)}
            if tars is not True and (tars is False or rel not in tars):
                continue
        path = work / rel
        if path.is_file() and _same(path, info, rel):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        remote.append(join(root, rel))
        local.append(str(path) + PULLING)
        stamps.append(_modified(info))
        size += int(info.get("size") or 0)
    if remote:
        fs.get(remote, local)
        for tmp, stamp in zip(local, stamps):  # whole files only: a killed download leaves a .tmp nothing reads
            if stamp is not None:
                os.utime(tmp, ns=(stamp, stamp))
            os.replace(tmp, tmp[: -len(PULLING)])
    if list_tars:
        remotetars.write_list(work / "prep", url.rstrip("/"), on_store, listed_at)
    return {"work_dir": str(work), "downloaded": len(remote), "bytes": size, "tar_sizes": tar_sizes}


def _modified(info: dict[str, Any]) -> int | None:
    """An object's time on the store in ns (S3's ``LastModified``, GCS's ``mtime``, Azure's ``last_modified``),
    None where not given."""
    when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    return int(when.timestamp() * 1e9) if hasattr(when, "timestamp") else None


def push(work: Path, url: str, lease: "StoreLease | None" = None) -> dict[str, Any]:
    """Publish the work folder's shared files that the store lacks or holds differently, phase after phase
    (:func:`phase`), so a reader never finds a record before its parts or a pointer before its manifest;
    ``{"uploaded", "bytes"}``. ``lease``: checked before the pointer is written (a writer that lost its lease
    publishes no snapshot). A tar the work folder left on the store (``remotetars``) is neither sent nor
    deleted; a snapshot whose shards would be on neither is not published (``RuntimeError`` naming one, before
    anything is uploaded)."""
    fs, root = store_fs(url)
    listing = store_listing(fs, root)
    files = local_files(work)
    todo: dict[int, list[str]] = {}
    for rel in files:
        info = listing.get(rel)
        if info is not None and _same(work / rel, info, rel):
            continue
        todo.setdefault(phase(rel), []).append(rel)
    missing = _missing_parts(work, todo.get(3, []), set(files) | set(listing))
    if missing:
        raise RuntimeError(f"{join(url, missing[0])}: a shard of the snapshot to publish is neither in the work "
                           f"folder {work} nor on the store; nothing was published")
    uploaded = size = 0
    for step in sorted(todo):
        if step == 4 and lease is not None:
            lease.check()
        names = todo[step]
        fs.put([str(work / rel) for rel in names], [join(root, rel) for rel in names])
        uploaded += len(names)
        size += sum((work / rel).stat().st_size for rel in names)
    return {"uploaded": uploaded, "bytes": size}


def _missing_parts(work: Path, manifests: list[str], present: set[str]) -> list[str]:
    """The shards (tars and indexes, ``/`` paths in the work folder) that the snapshot manifests ``manifests``
    name and ``present`` lacks."""
    missing = []
    for rel in manifests:
        if not rel.endswith("/manifest.json"):
            continue
        folder = posixpath.dirname(rel)
        for shard in json.loads((work / rel).read_text()).get("shards") or []:
            tar = posixpath.normpath(posixpath.join(folder, shard["path"]))
            index = shard.get("index")
            for part in (tar, *([posixpath.join(posixpath.dirname(tar), index["name"])] if index else [])):
                if part not in present:
                    missing.append(part)
    return missing


def unit_parts(stage_root: Path, record: dict[str, Any], shard_names: list[str]) -> list[Path]:
    """The files of a committed unit: those its record names (each shard's tar and index, its detail file),
    and every other file it wrote beside them, named ``<stage>-<unit id[:16]>...`` (curate's Parquet scores,
    its embeddings). ``shard_names``: the names in the stage's ``shards/`` folder."""
    parts = set()
    for shard in record.get("shards") or []:
        tar = stage_root / shard["path"]
        parts.add(tar)
        if shard.get("index"):
            parts.add(tar.with_name(shard["index"]["name"]))
    detail = (record.get("extra") or {}).get(DETAIL_KEY)
    if detail:
        parts.add(stage_root / detail)
    prefix = f"{record['stage']}-{record['unit_id'][:16]}"
    parts.update(stage_root / "shards" / name for name in shard_names
                 if name.startswith(prefix) and not name.endswith(LOCAL_SUFFIXES))
    return sorted(parts)


class Publisher(abc.ABC):
    """Calls :meth:`publish` every ``every_s`` seconds in a thread while entered, and once more on exit; a round
    that fails (a store that failed a request, a file removed meanwhile) is retried by the next one."""

    def __init__(self, every_s: float, name: str):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @abc.abstractmethod
    def publish(self) -> int:
        """One round: upload what changed since the last one; how many it sent."""

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.publish()
            except Exception:  # the next round, or the last one, tries again
                continue

    def __enter__(self) -> "Publisher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.publish()


class UnitPublisher(Publisher):
    """Publishes each unit the prep commits in the work folder while the prep runs: its parts, then its
    record, every ``every_s`` seconds in a thread and once more when stopped (a prep that fails or is
    stopped leaves its finished units on the store, where another machine's prep reuses them)."""

    def __init__(self, work: Path, url: str, every_s: float = PUBLISH_EVERY_S):
        super().__init__(every_s, "latentmill-publish")
        self.work, self.url = work, url
        self.fs, self.root = store_fs(url)
        self.known = {rel for rel in store_listing(self.fs, self.root) if phase(rel) == 1}  # records on the store
        self.published = 0
        self._pause = KillPoint(PAUSE_ENV, "publish", "rounds")  # tests: stop here for a SIGKILL

    def publish(self) -> int:
        """Upload the parts, then the records, of the committed units not published yet; how many units."""
        records, parts = [], []
        for units in sorted((self.work / "prep").glob("*/units")):
            new = [path for path in sorted(units.glob("*.json"))
                   if path.relative_to(self.work).as_posix() not in self.known]
            if not new:
                continue
            # listed after the records: a record is written after every file of its unit
            shard_names = sorted(os.listdir(units.parent / "shards")) if (units.parent / "shards").is_dir() else []
            for path in new:
                try:
                    record = json.loads(path.read_text())
                except (OSError, ValueError):  # written atomically: a record that does not read is not ours
                    continue
                records.append(path.relative_to(self.work).as_posix())
                parts += [p.relative_to(self.work).as_posix() for p in unit_parts(units.parent, record, shard_names)]
        for names in (parts, records):
            if names:
                self.fs.put([str(self.work / rel) for rel in names], [join(self.root, rel) for rel in names])
        self.known.update(records)
        self.published += len(records)
        if records:
            self._pause.step()
        return len(records)


def published_path(url: str, work: Path, path: str) -> str:
    """``path`` (under the work folder) as the URL of the same object on the store."""
    rel = os.path.relpath(path, work)
    return url.rstrip("/") if rel == "." else join(url, Path(rel).as_posix())


# ---------------------------------------------------------------------------------------------------------
# The writer lease
# ---------------------------------------------------------------------------------------------------------


class LostLease(OutputBusyError):
    """This writer's lease on a store ran out and another writer took it: it must not publish."""


class StoreLease:
    """A lease on an output on a store: the object ``<url>/<key>``, JSON naming its holder and when its lease
    ends (and ``fields``). Taken only if absent (or, once a lease ran out, only if still the version read),
    renewed and released only if still this holder's version: of two writers, one wins each write. The
    version is S3's or Azure's ETag (``If-None-Match: *``, ``If-Match``) or GCS's generation
    (``ifGenerationMatch``), :meth:`put` the one write that differs (:data:`PUT_IF`). ``key``: the writer lock
    ``.writer.lock`` by default; the training lease (:func:`training_lease`) or a training run's pin otherwise."""

    def __init__(self, url: str, holder: str, lease_s: float = LEASE_S, key: str = LOCK_FILE,
                 fields: dict[str, Any] | None = None):
        if not url.startswith(LEASE_SCHEMES):
            raise ConfigError(f"output_dir: {url}: the writer lease {NO_LEASE}")
        self.url, self.holder, self.lease_s, self.key, self.fields = url, holder, lease_s, key, fields or {}
        self.line = holder_line(holder)
        self.token_field = LEASE_TOKENS[url.split("://", 1)[0] + "://"]
        self.fs, root = store_fs(url)
        self.path = join(root, key)
        self.etag: str | None = None
        self.lost: str | None = None
        self.joined = False  # a node of a training on several nodes that another node's lease covers
        self._writing = threading.Lock()  # the renewals and record() write the same version in turn
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def name(self) -> str:
        return "writer lease" if self.key == LOCK_FILE else f"lease {self.key}"

    def _body(self, expires: float) -> bytes:
        return json.dumps({**self.fields, "holder": self.line, "expires": expires}).encode()

    def put(self, data: bytes, version: str | None) -> str:
        """Write ``data`` to the lock object only if it is absent (``version`` None) or still that version; the
        new version. Raises OSError (FileExistsError) when the condition does not hold."""
        return PUT_IF[self.token_field](self.fs, self.path, data, version)

    def _write(self, expires: float, version: str | None) -> str:
        return self.put(self._body(expires), version)

    def read(self) -> tuple[dict[str, Any], str] | None:
        """The lock object's holder and lease end, and its version (read first: a newer body fails the write
        conditional on it)."""
        try:
            etag = str(self.fs.info(self.path, refresh=True)[self.token_field])
            data = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        return data, etag

    def try_acquire(self) -> str | None:
        """Take the lease if it is free or ran out; None when taken, else the live holder's line."""
        self.line = holder_line(self.holder)  # its "since": when taken, kept by the renewals
        try:
            self.etag = self._write(time.time() + self.lease_s, None)
            return None
        except FileExistsError:
            pass
        found = self.read()
        if found is None:
            return self.try_acquire()
        data, etag = found
        if float(data.get("expires") or 0) > time.time():
            return str(data.get("holder") or "?")
        try:
            self.etag = self._write(time.time() + self.lease_s, etag)
        except OSError:  # another writer took it first
            return self.try_acquire()
        if data.get("holder"):  # a holder releases by clearing its line: this one stopped renewing
            print(f"{self.holder}: taking over the {self.name} of {self.url} left by {data['holder']} (its "
                  "lease ran out)", flush=True)
        return None

    def record(self, **fields: Any) -> None:
        """Add ``fields`` to the held lease's object now (the run folder a training on several nodes trains
        in, for the nodes that join it: :meth:`recorded`)."""
        with self._writing:
            self.fields.update(fields)
            self.etag = self._write(time.time() + self.lease_s, self.etag)

    def recorded(self, field: str, poll_s: float = 1.0, wait_s: float = 600.0) -> dict[str, Any]:
        """The lease object's body once its holder has recorded ``field`` (:meth:`record`), read by a node that
        joined it; raises :class:`OutputBusyError` when the lease ends or changes holder first, or after
        ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        first = None
        while True:
            found = self.read()
            data = found[0] if found is not None else {}
            first = first or data.get("holder")
            if not data.get("holder") or data.get("holder") != first or float(data.get("expires") or 0) <= time.time():
                raise OutputBusyError(f"{self.url}: the training this node joined ({first or 'gone'}) ended before "
                                      f"it recorded its {field}; start the nodes again")
            if field in data:
                return data
            if time.monotonic() > deadline:
                raise OutputBusyError(f"{self.url}: the training this node joined ({first}) recorded no {field} in "
                                      f"{wait_s:.0f} s")
            time.sleep(poll_s)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                with self._writing:
                    self.etag = self._write(time.time() + self.lease_s, self.etag)
            except OSError as err:
                found = self.read()
                self.lost = (f"the {self.name} of {self.url} was lost ({type(err).__name__}); now held by "
                             f"{found[0].get('holder') if found else 'nobody'}")
                return

    def check(self) -> None:
        """Raise :class:`LostLease` if the lease was lost (before publishing a snapshot)."""
        if self.lost:
            raise LostLease(self.lost + "; nothing more was published by this writer")

    def start(self) -> None:
        self._renewer = threading.Thread(target=self._renew, name="latentmill-lease", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.lost is None and self.etag is not None:
            try:
                if self.key == LOCK_FILE:  # an expired, holderless body: the next writer takes it over quietly
                    self.put(json.dumps({"holder": "", "expires": 0}).encode(), self.etag)
                else:  # a pin's object is its holder's alone
                    self.fs.rm_file(self.path)
            except OSError:
                pass


def _put_s3(fs: Any, path: str, data: bytes, version: str | None) -> str:
    """S3: ``If-None-Match: *`` (s3fs's create mode), else ``If-Match`` the ETag; a 412 is FileExistsError."""
    extra = {"IfMatch": version} if version else {}
    return str(fs.pipe_file(path, data, mode="overwrite" if version else "create", **extra)["ETag"])


def _put_gcs(fs: Any, path: str, data: bytes, version: str | None) -> str:
    """GCS: ``ifGenerationMatch`` the generation (0: absent). gcsfs has no argument for it: a multipart upload
    through its public call passes it (a store answers 412, raised as FileExistsError, when it differs)."""
    bucket, name = path.split("/", 1)
    meta = json.dumps({"name": name})
    body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
            "Content-Type: application/octet-stream\n\n").encode() + data + b"\n--==0==--"
    written = fs.call("POST", fs.base.removesuffix("storage/v1/") + "upload/storage/v1/b/{}/o", bucket,
                      uploadType="multipart", ifGenerationMatch=version or "0", data=body, json_out=True,
                      headers={"Content-Type": 'multipart/related; boundary="==0=="'})
    fs.invalidate_cache(path)
    return str(written["generation"])


def _put_azure(fs: Any, path: str, data: bytes, version: str | None) -> str:
    """Azure Blob: ``If-None-Match: *`` (adlfs's create mode), else ``If-Match`` the etag (azure-storage-blob's
    ``etag`` with ``MatchConditions.IfNotModified``). adlfs maps only the first refusal to FileExistsError:
    the others surface as azure-core's errors, mapped here."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

    condition = {"etag": version, "match_condition": MatchConditions.IfNotModified} if version else {"mode": "create"}
    try:
        return str(fs.pipe_file(path, data, **condition)["etag"])
    except (ResourceExistsError, ResourceModifiedError) as err:
        raise FileExistsError(f"{path}: {type(err).__name__}") from None
    except ResourceNotFoundError:  # the object went meanwhile: no version to replace
        raise FileNotFoundError(path) from None


# The conditional write of a lease object per store, by the field that names a version there (LEASE_TOKENS)
PUT_IF = {"ETag": _put_s3, "generation": _put_gcs, "etag": _put_azure}


@contextmanager
def store_lease(url: str, holder: str = "prep", on_busy: Literal["wait", "fail"] = "wait",
                lease_s: float = LEASE_S, poll_s: float = 1.0, key: str = LOCK_FILE) -> Iterator[StoreLease]:
    """Hold the writer lease of ``url`` (``key``: another lease of it) for the body, renewed in a thread
    (``writer_lock``'s rules: ``wait`` says who holds it and waits its turn, ``fail`` raises
    :class:`OutputBusyError` naming the holder)."""
    lease = StoreLease(url, holder, lease_s, key=key)
    said = False
    while (line := lease.try_acquire()) is not None:
        if on_busy == "fail":
            raise OutputBusyError(busy_message(url, line, f"lease {join(url, key)}", key))
        if not said:
            print(f"{holder}: waiting for a {holder_kind(line)} writing to {url} (held by {line})", flush=True)
            said = True
        time.sleep(poll_s)
    lease.start()
    try:
        yield lease
    finally:
        lease.release()


def check_not_busy(url: str) -> None:
    """Raise :class:`OutputBusyError` naming the holder if a writer holds the lease of ``url`` now."""
    found = StoreLease(url, "probe").read()
    if found is not None and float(found[0].get("expires") or 0) > time.time():
        raise OutputBusyError(busy_message(url, str(found[0].get("holder") or "?"), f"lease {join(url, LOCK_FILE)}"))


@contextmanager
def training_lease(url: str, lease_s: float = LEASE_S, rendezvous: str | None = None) -> Iterator[StoreLease | None]:
    """Hold the training lease of ``url`` (:data:`TRAIN_LOCK`) for the body: one training at a time writes the
    runs of an output on a store (two would prune, set aside and overwrite each other's checkpoints and
    ``train/LATEST``); a second raises :class:`OutputBusyError` naming the first. The writer lease's rules: it
    is renewed in a thread, and a holder that dies stops blocking once its lease ran out. Yields None, said in
    one line, on a store without conditional writes.

    ``rendezvous``: a training on several nodes, each running the same command (``EP/ID``, as the local
    training lock). The lease names it; the first node to start holds it, the others join it (the lease they
    get is not held: ``joined``, and :meth:`StoreLease.recorded` gives what the holder recorded, its run
    folder), while any other training is still refused."""
    if not url.startswith(LEASE_SCHEMES):
        if rendezvous is not None:
            raise ConfigError(f"output_dir: {url}: training on several nodes there needs the training lease, which "
                              f"{NO_LEASE}")
        print(f"train: a second training of {url} would not be refused: its lease {NO_LEASE}", flush=True)
        yield None
        return
    holder = "training" if rendezvous is None else f"training of rendezvous {rendezvous}"
    lease = StoreLease(url, holder, lease_s, key=TRAIN_LOCK)
    line = lease.try_acquire()
    if line is not None:
        if rendezvous is None or holder_of(line) != holder:
            raise OutputBusyError(busy_message(url, line, f"lease {join(url, TRAIN_LOCK)}", TRAIN_LOCK))
        print(f"{holder}: joining the training lease of {url} that this run's first node holds ({line})",
              flush=True)
        lease.joined = True
        yield lease
        return
    lease.start()
    try:
        yield lease
    finally:
        lease.release()


# ---------------------------------------------------------------------------------------------------------
# Pins, gc and compaction on a store
# ---------------------------------------------------------------------------------------------------------


def store_pins(url: str, drop_stale: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The live pins of the output at ``url`` by snapshot name (a user's always; a training run's while its
    lease lasts); with ``drop_stale`` the objects of lapsed leases are deleted (logged)."""
    fs, root = store_fs(url)
    pins: dict[str, list[dict[str, Any]]] = {}
    for rel in sorted(store_listing(fs, join(root, PINS))):
        path = join(root, PINS, rel)
        try:
            data = json.loads(fs.cat_file(path)) if rel.endswith(".pin") else {}
        except (FileNotFoundError, ValueError):  # removed meanwhile, or not a pin of ours
            continue
        if not isinstance(data, dict) or "snapshot" not in data:
            continue
        if "expires" in data and float(data["expires"] or 0) <= time.time():
            if drop_stale:
                print(f"gc: dropping the stale pin {rel} (its lease ran out: its process is gone)", flush=True)
                fs.rm_file(path)
            continue
        pins.setdefault(data["snapshot"], []).append({**data, "file": rel})
    return pins


def _after_pinning(url: str, name: str, poll_s: float = 1.0) -> None:
    """Once a pin of ``name`` is on the store: a gc that took the writer lease before may have listed the pins
    without it, so wait for that gc to end; then the snapshot must still be there (FileNotFoundError)."""
    probe, said = StoreLease(url, "probe"), False
    while ((found := probe.read()) is not None and holder_kind(str(found[0].get("holder") or "")) == "gc"
           and float(found[0].get("expires") or 0) > time.time()):
        if not said:
            print(f"pin: waiting for a gc of {url} to end (held by {found[0]['holder']})", flush=True)
            said = True
        time.sleep(poll_s)
    check_snapshot(url, name)


def pin_store(url: str, snapshot: str) -> str:
    """``latentmill pin`` on a store: the object ``pins/<name>.pin``, kept until :func:`unpin_store`; the name."""
    name = check_snapshot(url, snapshot)
    fs, root = store_fs(url)
    path = join(root, PINS, f"{name}.pin")
    fs.pipe_file(path, json.dumps(pin_record(name)).encode())
    try:
        _after_pinning(url, name)
    except FileNotFoundError:
        fs.rm_file(path)
        raise
    return name


def unpin_store(url: str, snapshot: str) -> bool:
    """Remove the user's pin of ``snapshot`` on a store; False when it was not pinned (training pins stay)."""
    fs, root = store_fs(url)
    name = check_snapshot(url, snapshot) if snapshot == "latest" else snapshot
    path = join(root, PINS, f"{name}.pin")
    if not fs.exists(path):
        return False
    fs.rm_file(path)
    return True


@contextmanager
def pinned_on_store(url: str, snapshot: str, lease_s: float = LEASE_S) -> Iterator[str]:
    """Pin the snapshot a training run streams from a store for as long as the run lives: a lease of its own
    (``pins/<name>@<host>-<pid>.pin``), renewed in a thread, deleted at the end; it lapses when the process
    dies, and the next gc drops it. Yields the snapshot's name."""
    name = check_snapshot(url, snapshot)
    key = f"{PINS}/{name}@{socket.gethostname()}-{os.getpid()}.pin"
    try:
        lease = StoreLease(url, "training", lease_s, key=key, fields=pin_record(name, "training"))
    except ConfigError as err:  # no conditional writes there: train, but say that nothing protects the snapshot
        print(f"train: cannot pin snapshot {name} ({err}); a gc of {url} could remove it while this run reads it",
              flush=True)
        yield name
        return
    held = lease.try_acquire()
    if held is not None:  # the key names this process: only a second pin of the same snapshot in it lands here
        raise OutputBusyError(f"{join(url, key)}: this process pins {name} already ({held})")
    lease.start()
    try:
        _after_pinning(url, name)
        yield name
    finally:
        lease.release()


def gc_store(url: str, keep: int, dry_run: bool = False, on_busy: Literal["wait", "fail"] = "wait") -> dict[str, Any]:
    """``latentmill gc`` of an output on a store: under the writer lease, pull it but its tars (the work folder
    lists them, ``stages.remotetars``), run the local gc in the work folder with the store's live pins
    (:func:`store_pins`, read once the lease is held: a pin made later waits for this gc, see
    :func:`_after_pinning`), then delete from the store what that gc removed (a tar: what it took off the
    list), in the reverse of publishing order (snapshot manifests, then unit records, then their parts): a
    reader never finds a kept snapshot or record without its parts. ``dry_run``: report only (nothing
    deleted, no lease). The report's ``store.deleted`` counts objects."""
    from latentmill.pipelines.retention import gc

    if dry_run:
        work = Path(pull(url, tars=False, list_tars=True)["work_dir"])
        return {**gc(work, keep, dry_run=True, pins=store_pins(url)), "store": {"url": url, "deleted": 0}}
    with store_lease(url, "gc", on_busy=on_busy):
        pins = store_pins(url, drop_stale=True)
        work = Path(pull(url, tars=False, list_tars=True)["work_dir"])
        report = gc(work, keep, on_busy=on_busy, pins=pins)
        fs, root = store_fs(url)
        gone = [rel for rel in store_listing(fs, root) if shared(rel) and not (work / rel).is_file()
                and not (rel.endswith(".tar") and remotetars.held(work / rel))]
        for step in (3, 1, 0, 2):  # LATEST (4) names a kept snapshot: gc never drops it
            names = [join(root, rel) for rel in gone if phase(rel) == step]
            if names:
                fs.rm(names)
    return {**report, "store": {"url": url, "deleted": len(gone)}}


def compact_store(url: str, small_below: float = 0.5, dry_run: bool = False,
                  on_busy: Literal["wait", "fail"] = "wait") -> dict[str, Any]:
    """``latentmill compact`` of an output on a store: under the writer lease, pull its manifests, records and
    indexes, plan from them and the store's listing (the same rule as locally), download only the tars of the
    units it merges, compact the work folder as locally (the same merged bytes), then publish as a prep does
    (:func:`push`: the new parts, then their records, then the cache manifest, the snapshot, ``LATEST``
    last). ``dry_run``: report only (no tar downloaded, nothing written to the store, no lease). The report's
    ``store`` says what moved."""
    from latentmill.pipelines.compaction import cache_stage, compact
    from latentmill.stages.compact import plan_compaction

    def sizes_in(pulled: dict[str, Any]) -> dict[str, int]:  # the cache's tars, by path in its stage folder
        return {rel[len(CACHE):]: n for rel, n in pulled["tar_sizes"].items() if rel.startswith(CACHE)}

    if dry_run:
        pulled = pull(url, tars=False)
        return compact(pulled["work_dir"], small_below, dry_run=True, tar_sizes=sizes_in(pulled))
    with store_lease(url, "compact", on_busy=on_busy) as lease:
        pulled = pull(url, tars=False)
        work, tar_sizes = Path(pulled["work_dir"]), sizes_in(pulled)
        groups, _ = plan_compaction(cache_stage(work), small_below, tar_sizes=tar_sizes)
        merged = pull(url, work, tars={CACHE + s.path for group in groups for record in group for s in record.shards})
        report = compact(work, small_below, on_busy=on_busy, tar_sizes=tar_sizes)
        pushed = push(work, url, lease)
    report["snapshot"]["path"] = published_path(url, work, report["snapshot"]["path"])
    return {**report, "store": {"url": url, "work_dir": str(work),
                                "downloaded": pulled["downloaded"] + merged["downloaded"],
                                "bytes_downloaded": pulled["bytes"] + merged["bytes"],
                                "uploaded": pushed["uploaded"], "bytes_uploaded": pushed["bytes"]}}


# ---------------------------------------------------------------------------------------------------------
# Reading an output on a store: inspect and verify
# ---------------------------------------------------------------------------------------------------------


def local_view(url: str) -> Path:
    """The work-folder copy of ``url``'s manifests, records and quarantine lists (not the tars), for
    ``latentmill inspect``: ``url`` is an output_dir, or a folder below one (``.../snapshots/NAME``)."""
    text = url.rstrip("/")
    for marker in ("/snapshots", "/prep"):
        if marker + "/" in text + "/":
            root, rest = text.split(marker, 1)
            rel = marker.strip("/") + rest
            break
    else:
        root, rel = text, ""
    work = Path(pull(root, tars=False)["work_dir"])
    return work / rel if rel else work


def _manifests(fs: Any, root: str) -> list[str]:
    """The manifest objects to verify below ``root``: its own, else every stage's and snapshot's."""
    own = join(root, "manifest.json")
    if fs.exists(own):
        return [own]
    found = sorted(path for path in fs.find(root) if path.endswith("/manifest.json"))
    if not found:
        raise FileNotFoundError(f"no manifest under {root}; run `latentmill prep` first")
    return found


def _sha256_object(fs: Any, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb", block_size=1 << 22) as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_store(url: str) -> int:
    """``latentmill verify`` of an output on a store: re-hash every shard, and its index, that a manifest
    there lists, reading the store's objects (not a local copy); 1 if any is missing or differs."""
    fs, root = store_fs(url)
    bad = checked = 0
    seen: set[str] = set()
    for manifest_path in _manifests(fs, root):
        manifest = json.loads(fs.cat_file(manifest_path))
        folder = posixpath.dirname(manifest_path)
        for shard in manifest.get("shards") or []:
            path = posixpath.normpath(posixpath.join(folder, shard["path"]))
            if path in seen:  # a snapshot lists the cache's shards again
                continue
            seen.add(path)
            checked += 1
            index = shard.get("index")
            index_path = posixpath.join(posixpath.dirname(path), index["name"]) if index else None
            if not fs.exists(path):
                print(f"MISSING  {fs.unstrip_protocol(path)}")
                bad += 1
            elif _sha256_object(fs, path) != shard["sha256"]:
                print(f"MISMATCH {fs.unstrip_protocol(path)}: sha256 differs from the manifest")
                bad += 1
            elif index_path is not None and (not fs.exists(index_path)
                                              or _sha256_object(fs, index_path) != index["sha256"]):
                print(f"MISMATCH {fs.unstrip_protocol(index_path)}: the shard index differs from the manifest")
                bad += 1
    print(f"verified {checked} shards on {url}: {checked - bad} ok, {bad} bad")
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------------------
# Training runs on a store: the run folder in the work folder, published while it trains
# ---------------------------------------------------------------------------------------------------------


def check_snapshot(url: str, name: str) -> str:
    """The name of the store's snapshot ``name`` (``latest``: the one ``snapshots/LATEST`` names); raise
    ``FileNotFoundError`` as ``resolve_snapshot`` does when the store holds no such snapshot."""
    fs, root = store_fs(url)
    folder = join(url, "snapshots")
    if name == "latest":
        try:
            name = fs.cat_file(join(root, "snapshots", LATEST)).decode().strip()
        except FileNotFoundError:
            raise FileNotFoundError(f"no snapshot published under {folder}: run `latentmill prep` first") from None
    try:  # asked of the store, not of a cached listing: a gc elsewhere may have removed it
        fs.info(join(root, "snapshots", name, "manifest.json"), refresh=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"snapshot {name!r} not found under {folder}; `latentmill inspect {url}` lists the "
                                "published ones") from None
    return name
