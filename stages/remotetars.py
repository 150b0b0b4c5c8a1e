"""Tars a work folder leaves on its object store until a stage reads them (docs/object-stores.md).

A prep of an ``output_dir`` on a store runs in a local work folder that holds what the store holds but the
shards' tars (``latentmill.pipelines.objectstore.pull`` with ``tars=False``). That pull writes the tars the
store holds, with their sizes and the MD5s the store gives, to ``prep/.store-tars.json`` (local: a dot name is
never published). Then, in any process that opens a tar of that folder (a process-pool worker as well):

* a unit counts as committed when its record is there and each of its tars is in the folder or on that list
  (:func:`held`): a reused unit costs no download;
* a tar's size is its file's or the list's (:func:`tar_size`): planning estimates read no tar;
* a reader that opens a tar the folder lacks gets it first (:func:`local_tar`): downloaded whole under a name
  of its own ending in ``.pull.tmp``, checked against the list (size, MD5 where given) and renamed into place,
  so a download killed midway is never read;
* a reader that wants a few members of such a tar reads only those (:func:`read_ranges`: one ranged request
  each), e.g. the json members curation's duplicate index enters.

A gc there plans over the listed tars too (:func:`listed`) and takes those it drops off the list (:func:`forget`):
what the list no longer names and the folder lacks is what the store deletes.

Every download is logged in ``prep/.store-fetched.jsonl`` (:func:`fetched`) for the prep's summary. A folder
without the list (a local ``output_dir``) is untouched: every function here then looks at files only.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

from latentmill.stages.killpoint import KillPoint

from latentmill.core import durable
from latentmill.core.hashing import md5_file

LIST_FILE = ".store-tars.json"  # in the prep folder: {"url": output URL, "tars": {"<stage>/shards/x.tar": entry}}
FETCH_LOG = ".store-fetched.jsonl"  # in the prep folder: one line per download
PULLING = ".pull.tmp"  # suffix of a file being downloaded (objectstore.PULLING): renamed into place once checked
PAUSE_ENV = "LATENTMILL_FETCH_PAUSE_AFTER"  # tests: pause after this many downloads, before the rename, for a kill

_lists: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}  # list path -> (its (mtime_ns, size), content)
_lock = threading.Lock()  # one writer of a list at a time in this process
_pause = KillPoint(PAUSE_ENV, "fetch", "downloads")


def write_list(prep_dir: Path, url: str, tars: dict[str, dict[str, Any]], listed_at: float) -> bool:
    """Record the tars the store of ``url`` held when it was listed at ``listed_at`` (``time.time()``), by path in
    the prep folder (``{"size", "md5"}``), unless the folder's list comes from a later listing (another pull of
    this machine that started later and finished first): an older listing never replaces a newer one. Whether
    it was written."""
    prep_dir.mkdir(parents=True, exist_ok=True)
    with _lock:
        current = _read_list(prep_dir / LIST_FILE)
        if current is not None and current.get("listed_at", 0) > listed_at:
            return False
        durable.write_json(prep_dir / LIST_FILE, {"url": url, "listed_at": listed_at, "tars": tars}, indent=None)
    (prep_dir / FETCH_LOG).unlink(missing_ok=True)
    return True


def _place(tar: Path) -> tuple[Path, str]:
    """The prep folder of a stage's tar (``<prep>/<stage>/shards/<name>.tar``) and the tar's path in it."""
    return tar.parent.parent.parent, f"{tar.parent.parent.name}/{tar.parent.name}/{tar.name}"


def _read_list(path: Path) -> dict[str, Any] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    sig = (stat.st_mtime_ns, stat.st_size)
    cached = _lists.get(str(path))
    if cached is not None and cached[0] == sig:
        return cached[1]
    data = json.loads(path.read_text())
    _lists[str(path)] = (sig, data)
    return data


def on_store(tar: str | Path) -> tuple[str, str, dict[str, Any]] | None:
    """``(output URL, path in the prep folder, {"size", "md5"})`` of a tar that the store holds, from the
    folder's list; None where the folder has no list or the list does not name it."""
    prep, rel = _place(Path(tar))
    listing = _read_list(prep / LIST_FILE)
    if listing is None or rel not in listing["tars"]:
        return None
    return listing["url"], rel, listing["tars"][rel]


def held(tar: str | Path) -> bool:
    """Whether the tar is in the folder or, for a work folder of a store, on the store."""
    return os.path.isfile(tar) or on_store(tar) is not None


def tar_size(tar: str | Path) -> int:
    """The tar's bytes: its file's, else the store's object's (``FileNotFoundError`` when neither has it)."""
    try:
        return os.stat(tar).st_size
    except FileNotFoundError:
        found = on_store(tar)
        if found is None:
            raise
        return int(found[2]["size"])


def listed(shard_dir: Path) -> list[Path]:
    """The tars of a stage's ``shards`` folder that the store holds and the folder lacks (none without a list)."""
    prep = shard_dir.parent.parent
    listing = _read_list(prep / LIST_FILE)
    prefix = f"{shard_dir.parent.name}/{shard_dir.name}/"
    names = [rel[len(prefix):] for rel in (listing or {"tars": {}})["tars"] if rel.startswith(prefix)]
    return [shard_dir / name for name in sorted(names) if "/" not in name and not (shard_dir / name).is_file()]


def forget(tars: Iterable[Path]) -> None:
    """Take these tars off their folder's list (a gc dropped them: the store's copies are deleted next)."""
    by_prep: dict[Path, set[str]] = {}
    for tar in tars:
        prep, rel = _place(Path(tar))
        by_prep.setdefault(prep, set()).add(rel)
    for prep, rels in by_prep.items():
        listing = _read_list(prep / LIST_FILE)
        if listing is not None and rels & listing["tars"].keys():
            durable.write_json(prep / LIST_FILE, {**listing, "tars": {
                rel: entry for rel, entry in listing["tars"].items() if rel not in rels}}, indent=None)


def _object(url: str, rel: str) -> tuple[Any, str]:
    from latentmill.core.store import join, store_fs

    fs, root = store_fs(url)
    return fs, join(root, "prep", rel)


def _log(prep: Path, entry: dict[str, Any]) -> None:
    with open(prep / FETCH_LOG, "a") as fh:  # one short line per write, appended: whole lines from any process
        fh.write(json.dumps(entry) + "\n")


def local_tar(tar: str | Path) -> Path:
    """The tar as a local file: a tar the folder lacks and its store holds is downloaded whole first (under a
    temporary name, checked against the store's size and MD5, then renamed into place). A tar neither has is
    returned as it is: opening it raises ``FileNotFoundError`` as before."""
    tar = Path(tar)
    if tar.is_file():
        return tar
    found = on_store(tar)
    if found is None:
        return tar
    url, rel, entry = found
    fs, path = _object(url, rel)
    tmp = tar.with_name(f"{tar.name}.{os.getpid()}-{threading.get_ident()}{PULLING}")  # one per reader
    try:
        fs.get_file(path, str(tmp))
        _pause.step()
        size = tmp.stat().st_size
        if size != int(entry["size"]):
            raise OSError(f"{fs.unstrip_protocol(path)}: downloaded {size} bytes, the store listed {entry['size']}")
        if entry.get("md5") and md5_file(tmp) != entry["md5"]:
            raise OSError(f"{fs.unstrip_protocol(path)}: the downloaded bytes' MD5 differs from the store's")
        os.replace(tmp, tar)
    finally:
        tmp.unlink(missing_ok=True)
    _log(tar.parent.parent.parent, {"tar": rel, "bytes": size})
    return tar


def read_ranges(tar: str | Path, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes at ``(offset, size)`` of each range of the tar: read from its file, or, from a store that
    holds a tar the folder lacks, one ranged request each (the tar is not downloaded)."""
    tar = Path(tar)
    found = None if tar.is_file() else on_store(tar)
    if found is None:
        fd = os.open(tar, os.O_RDONLY)
        try:
            return [os.pread(fd, size, offset) for offset, size in ranges]
        finally:
            os.close(fd)
    url, rel, _ = found
    fs, path = _object(url, rel)
    data = fs.cat_ranges([path] * len(ranges), [o for o, _ in ranges], [o + s for o, s in ranges],
                         on_error="raise") if ranges else []
    _log(tar.parent.parent.parent, {"ranges": rel, "count": len(ranges), "bytes": sum(len(d) for d in data)})
    return list(data)


def fetched(prep_dir: Path) -> dict[str, int]:
    """What readers downloaded since the list was written: ``{"tars", "tar_bytes", "ranges", "range_bytes"}``."""
    counts = {"tars": 0, "tar_bytes": 0, "ranges": 0, "range_bytes": 0}
    try:
        lines = (prep_dir / FETCH_LOG).read_text().splitlines()
    except FileNotFoundError:
        return counts
    for line in lines:
        entry = json.loads(line)
        if "tar" in entry:
            counts["tars"] += 1
            counts["tar_bytes"] += int(entry["bytes"])
        else:
            counts["ranges"] += int(entry["count"])
            counts["range_bytes"] += int(entry["bytes"])
    return counts


