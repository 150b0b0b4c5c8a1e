"""Retention: one writer per output_dir, pinned snapshots, and ``gc`` of what no kept snapshot references.

Shards are content-addressed and never rewritten, so nothing goes stale by itself: a nightly refresh whose
data, options or models change keeps every older shard. ``gc`` frees them by one rule: **keep what the
newest N snapshots and every pinned snapshot reference, in every stage, and what the current stage
manifests reference (the state the next refresh starts from); delete the rest.**

What a kept snapshot references, per stage (``<output_dir>/prep/<stage>/``):

* ``cache``: every file its manifest names (shards, the empty-prompt embedding, any index), the records
  of its ``units`` and every file those name (a shard's sidecars, ``<shard stem>.*``, go with it).
* ``bucket``, ``caption``, ``ingest``: for each shard a kept unit of the next stage read (a unit's
  ``inputs`` are the sha256 of its input shards), one unit that wrote it (a current one when there is one,
  else the newest), followed up to ingest, with their files.

Deleted: unit records (``units/*.json``), shards (``shards/<stage>-*``), ``empty_prompt-*`` and ``prompts-*`` files and
snapshot folders that none of that names, and temporaries (``*.tmp``) that a killed writer left. Nothing
else in an output_dir is touched (manifests, quarantine lists, hash stores, training runs).

Locks and pins (the same staleness rule for both: an ``flock`` that the kernel drops when its process dies,
on this host or, through the file system's lock manager, on another):

* ``<output_dir>/.writer.lock``: held by prep, gc and compaction for their whole run. A second writer waits
  (saying who holds it) or fails with a message naming it. A lock whose holder died is taken over with a
  log line: the kernel has released it; the file still names the dead holder.
* ``<output_dir>/.train.lock``: the same lock, held by a training (``pipelines.flows.run_train``, the process
  that launches torchrun) for its whole run: one training writes an output's runs at a time, a second is
  refused. A training on several nodes names its rendezvous in it, and the other nodes' same command joins it.
* ``<output_dir>/pins/<snapshot>.pin``: a user's pin (``latentmill pin``), kept until ``unpin``.
  ``<output_dir>/pins/<snapshot>@<host>-<pid>.pin``: a training process's pin, locked by that process for
  the run and removed at its end; a gc finds the lock free when the process is gone and drops the pin.
  ``pins/.lock`` is held for the instant a pin is made (and its snapshot checked) and while gc chooses and
  removes snapshots, so a training run never pins a snapshot gc is removing.

A SIGKILL at any point of a gc leaves every kept snapshot readable: dropped snapshots are first renamed out
of sight (``snapshots/.trash-<name>``, atomic), and only files that no kept snapshot, current manifest or
kept unit names are deleted. The next gc finishes the work.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from latentmill.pipelines.snapshot import LATEST, STAGES, latest_name, resolve_snapshot, snapshots_dir
from latentmill.stages import remotetars
from latentmill.stages.killpoint import KillPoint

from latentmill.core import durable

LOCK_FILE = ".writer.lock"
TRAIN_LOCK = ".train.lock"  # the lock (or, on a store, the lease) of the one training that writes an output's runs
PINS = "pins"
TRASH = ".trash-"
PAUSE_ENV = "LATENTMILL_GC_PAUSE_AFTER"  # tests: stop for a kill after this many removals


class OutputBusyError(RuntimeError):
    """Another writer holds the output_dir's writer lock (``on_busy`` is ``fail``), or another training its
    training lock."""


# ---------------------------------------------------------------------------------------------------------
# The writer lock
# ---------------------------------------------------------------------------------------------------------

_held = threading.local()  # lock paths this thread holds: a nested writer_lock (prep -> compaction) passes


def holder_line(holder: str) -> str:
    """Who holds a writer lock: process, host, what it runs and since when (no credential, no path)."""
    return (f"PID {os.getpid()} on {socket.gethostname()}: {holder} since "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")


def holder_of(line: str) -> str:
    """``training of rendezvous EP/ID`` from ``PID 12 on host: training of rendezvous EP/ID since ...``."""
    return line.split(": ", 1)[-1].rsplit(" since ", 1)[0]


def holder_kind(line: str) -> str:
    """``prep`` from ``PID 12 on host: prep since ...`` (``writer`` when the line is not ours)."""
    return holder_of(line).split(" ", 1)[0] if ": " in line else "writer"


def busy_message(output_dir: str | Path, line: str, lock: str, name: str = LOCK_FILE) -> str:
    """The one line that refuses a second writer (``name``: the lock file's name; ``lock``: ``lock PATH`` or
    ``lease URL``), naming the holder and what to do."""
    then = "set prep.on_busy=wait to queue behind it" if name == LOCK_FILE else "train into another output_dir"
    return (f"{output_dir} is busy: a {holder_kind(line)} is writing it ({line}; {lock}). Wait for it to finish, "
            f"or {then}")


def _try_lock(fh: Any, mode: int = fcntl.LOCK_EX) -> str | None:
    """Lock ``fh`` without waiting: None when locked, else the holder's line. A holder writes its line just
    after locking and empties the file just before unlocking, so an empty file held by another is tried
    again for a moment."""
    for _ in range(20):
        try:
            fcntl.flock(fh, mode | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            fh.seek(0)
            line = fh.read().strip()
            if line:
                return line
        time.sleep(0.05)
    return "?"


@contextmanager
def writer_lock(output_dir: str | Path, holder: str = "prep", on_busy: Literal["wait", "fail"] = "wait",
                name: str = LOCK_FILE, joins: bool = False) -> Iterator[None]:
    """Hold ``<output_dir>/.writer.lock`` for the body: one prep, gc or compaction writes an output_dir at a time.

    Another holder: ``on_busy="wait"`` prints who holds it and waits its turn (several nodes of ``latentmill
    run --nnodes`` prep in turn, the later ones find the work committed); ``"fail"`` raises
    :class:`OutputBusyError` naming it. The lock is an ``flock``: the kernel drops it when its holder dies,
    so a killed run never blocks the next, which says that it takes the lock over. Re-entrant per thread.
    ``name``: another lock file of the same kind (:func:`training_lock`); ``joins``: a holder of the same
    ``holder`` text is this run's own (a multi-node training's first node), so the body runs without the lock.
    """
    path = Path(output_dir) / name
    what = "writer lock" if name == LOCK_FILE else "training lock"
    key = os.path.abspath(path)
    held = getattr(_held, "paths", None)
    if held is None:
        held = _held.paths = set()
    if key in held:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        line = _try_lock(fh)
        if line is not None and joins and line.split(": ", 1)[-1].rsplit(" since ", 1)[0] == holder:
            print(f"{holder}: joining the {what} of {output_dir} that this run's first node holds ({line})",
                  flush=True)
            yield
            return
        if line is not None:
            if on_busy == "fail":
                raise OutputBusyError(busy_message(output_dir, line, f"lock {path}", name))
            other = holder_kind(line)
            print(f"{holder}: waiting for {'another ' if other == holder else 'a '}{other} writing to "
                  f"{output_dir} (held by {line})", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        left = fh.read().strip()
        if left:  # a holder releases by emptying the file: this one was killed, the kernel freed its lock
            print(f"{holder}: taking over the {what} of {output_dir} left by {left} (that process is "
                  "gone)", flush=True)
        fh.seek(0)
        fh.truncate()
        fh.write(holder_line(holder) + "\n")
        fh.flush()
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
            fh.seek(0)
            fh.truncate()
            fh.flush()
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def training_lock(output_dir: str | Path, rendezvous: str | None = None) -> Iterator[None]:
    """Hold ``<output_dir>/.train.lock`` for the body: one training writes an output's runs at a time (two
    would prune, set aside and overwrite each other's checkpoints and ``train/LATEST``); a second raises
    :class:`OutputBusyError` naming the first. The writer lock's kind: a holder that dies stops blocking.

    ``rendezvous``: a training on several nodes, each running the same command on a shared file system; the
    lock names it, the first node to start holds it and the others join (their command names the same
    rendezvous), while any other training is refused. A missing ``output_dir`` is not created: it holds no
    snapshot to train on, which the caller says next.
    """
    if not Path(output_dir).is_dir():
        yield
        return
    holder = "training" if rendezvous is None else f"training of rendezvous {rendezvous}"
    with writer_lock(output_dir, holder, on_busy="fail", name=TRAIN_LOCK, joins=rendezvous is not None):
        yield


def check_not_busy(output_dir: str | Path) -> None:
    """Raise :class:`OutputBusyError` naming the holder if a writer holds the output_dir's lock now.

    A probe, for ``on_busy: fail`` to fail before any start-up work (the run takes the lock itself later).
    """
    path = Path(output_dir) / LOCK_FILE
    if not path.is_file() or os.path.abspath(path) in (getattr(_held, "paths", None) or set()):
        return
    with open(path, "a+") as fh:
        line = _try_lock(fh, fcntl.LOCK_SH)
        if line is not None:
            raise OutputBusyError(busy_message(output_dir, line, f"lock {path}"))
        fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------
# Pins
# ---------------------------------------------------------------------------------------------------------


def pins_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / PINS


@contextmanager
def _pins_lock(output_dir: str | Path) -> Iterator[None]:
    folder = pins_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pin_is_live(path: Path) -> bool:
    """A user's pin always; a process's pin while that process holds its lock."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if data.get("pid") is None:
        return True
    try:
        with open(path, "rb") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
    except FileNotFoundError:
        return False
    return False


def list_pins(output_dir: str | Path, drop_stale: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Live pins by snapshot name; with ``drop_stale`` the pins of dead processes are removed (logged)."""
    pins: dict[str, list[dict[str, Any]]] = {}
    folder = pins_dir(output_dir)
    for path in sorted(folder.glob("*.pin")) if folder.is_dir() else []:
        if not _pin_is_live(path):
            if drop_stale:
                print(f"gc: dropping the stale pin {path.name} (its process is gone)", flush=True)
                path.unlink(missing_ok=True)
            continue
        data = json.loads(path.read_text())
        pins.setdefault(data["snapshot"], []).append({**data, "file": path.name})
    return pins


def pin_record(snapshot: str, by: str = "user") -> dict[str, Any]:
    """What a pin file (or object, on a store) holds: its snapshot, who pinned it and when; a training
    process's pin (``by="training"``) also names the process."""
    record: dict[str, Any] = {"snapshot": snapshot, "by": by}
    if by == "training":
        record.update(pid=os.getpid(), host=socket.gethostname())
    return {**record, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def pin(output_dir: str | Path, snapshot: str) -> str:
    """Pin ``snapshot`` (a published name or ``latest``) until :func:`unpin`; returns its name."""
    with _pins_lock(output_dir):
        name = resolve_snapshot(output_dir, snapshot).name
        path = pins_dir(output_dir) / f"{name}.pin"
        durable.write_text(path, json.dumps(pin_record(name)))
    return name


def unpin(output_dir: str | Path, snapshot: str) -> bool:
    """Remove the user's pin of ``snapshot``; False when it was not pinned. Training pins stay theirs."""
    name = latest_name(output_dir) if snapshot == "latest" else snapshot
    path = pins_dir(output_dir) / f"{name}.pin"
    with _pins_lock(output_dir):
        if not path.is_file():
            return False
        path.unlink()
    return True


@contextmanager
def pinned_for_training(output_dir: str | Path, snapshot: str) -> Iterator[Path]:
    """Pin the snapshot a training process reads for as long as it runs; yields the snapshot's folder.

    ``latest`` is resolved under the pins lock, so the pin names the snapshot this process reads. The pin
    file is locked before it becomes visible (locked as ``.tmp``, then renamed), so a gc never sees it
    unlocked while its process lives; when the process dies, its lock goes and a gc drops the pin.
    """
    host, pid = socket.gethostname(), os.getpid()
    try:
        pins_dir(output_dir).mkdir(parents=True, exist_ok=True)
        (pins_dir(output_dir) / ".lock").touch()
    except OSError as err:  # a read-only output_dir: train, but say that nothing protects the snapshot
        folder = resolve_snapshot(output_dir, snapshot)
        print(f"train: cannot pin snapshot {folder.name} ({err}); a gc of {output_dir} could remove it "
              "while this run reads it", flush=True)
        yield folder
        return
    with _pins_lock(output_dir):
        folder = resolve_snapshot(output_dir, snapshot)
        path = pins_dir(output_dir) / f"{folder.name}@{host}-{pid}.pin"
        tmp = path.with_name(path.name + ".tmp")
        fh = open(tmp, "w")
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(json.dumps(pin_record(folder.name, "training")))
        fh.flush()
        os.replace(tmp, path)
    try:
        yield folder
    finally:
        path.unlink(missing_ok=True)
        fh.close()


# ---------------------------------------------------------------------------------------------------------
# What is referenced
# ---------------------------------------------------------------------------------------------------------


def published(output_dir: str | Path) -> list[str]:
    """Published snapshot names, oldest first (by their number)."""
    root = snapshots_dir(output_dir)
    names = [p.name for p in root.iterdir() if p.is_dir() and p.name[:4].isdigit()
             and (p / "manifest.json").is_file()] if root.is_dir() else []
    return sorted(names, key=lambda n: (int(n.split("-")[0]), n))


def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value)


def _named_files(obj: Any, base: Path) -> set[Path]:
    """Every string in ``obj`` that names an existing file relative to ``base`` (paths of any key: shards,
    indexes, embeddings; a tar a store's work folder left on the store), normalised."""
    found = set()
    for text in _strings(obj):
        if "/" not in text and "." not in text:
            continue
        path = Path(os.path.normpath(base / text))
        if path.is_file() or (path.suffix == ".tar" and remotetars.held(path)):
            found.add(path)
    return found


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class _Stage:
    """One stage folder's records, read once."""

    root: Path
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # unit id -> record JSON
    by_output: dict[str, list[str]] = field(default_factory=dict)  # output shard sha256 -> unit ids
    mtimes: dict[str, int] = field(default_factory=dict)  # unit id -> record mtime (ns)

    @classmethod
    def read(cls, root: Path) -> "_Stage":
        stage = cls(root)
        units = root / "units"
        for path in sorted(units.glob("*.json")) if units.is_dir() else []:
            record = _read_json(path)
            if not isinstance(record, dict):
                continue
            unit_id = path.stem
            stage.records[unit_id] = record
            stage.mtimes[unit_id] = path.stat().st_mtime_ns
            for shard in record.get("shards") or []:
                stage.by_output.setdefault(shard.get("sha256", ""), []).append(unit_id)
        return stage


@dataclass
class Plan:
    """What a gc keeps and removes."""

    keep: int
    snapshots_kept: list[str]
    snapshots_removed: list[str]
    pinned: dict[str, list[dict[str, Any]]]
    remove: dict[str, list[Path]]  # stage -> files to delete (records first, then shards and the rest)
    kept_files: dict[str, set[Path]]  # stage -> files that stay
    trash: list[Path]  # snapshot folders renamed out of sight by an earlier, interrupted gc


def _stage_files(root: Path, stage: str) -> list[Path]:
    """The files gc may delete in one stage: unit records, this stage's shards (and sidecars), the cache's
    empty-prompt and validation-prompt embeddings, and temporaries. Anything else is never a candidate."""
    files = []
    if (root / "units").is_dir():
        files += [p for p in (root / "units").iterdir() if p.is_file() and p.name.endswith((".json", ".tmp"))]
    if (root / "shards").is_dir():
        files += [p for p in (root / "shards").iterdir() if p.is_file() and p.name.startswith(f"{stage}-")]
        # a store's work folder: the tars left on the store (stages.remotetars) are this output's files too
        files += [p for p in remotetars.listed(root / "shards") if p.name.startswith(f"{stage}-")]
    if root.is_dir():
        files += [p for p in root.iterdir() if p.is_file() and p.name.startswith(("empty_prompt-", "prompts-"))]
    return sorted(files)


def plan_gc(output_dir: str | Path, keep: int, pins: dict[str, list[dict[str, Any]]] | None = None) -> Plan:
    """What ``gc(output_dir, keep)`` would keep and remove now (nothing is changed). ``pins``: the live pins
    by snapshot (default: the output_dir's pins folder's; a gc on a store passes the store's)."""
    if keep < 1:
        raise ValueError(f"--keep: must be >= 1 (the newest snapshot is always kept), got {keep}")
    output_dir = Path(output_dir)
    names = published(output_dir)
    pinned = list_pins(output_dir) if pins is None else pins
    latest = latest_name(output_dir)
    kept = set(names[-keep:]) | {n for n in names if n in pinned} | ({latest} if latest in names else set())
    snapshots_kept = [n for n in names if n in kept]
    removed = [n for n in names if n not in kept]
    root = snapshots_dir(output_dir)
    trash = sorted(root.glob(f"{TRASH}*")) if root.is_dir() else []
    prep = output_dir / "prep"
    stages = {s: _Stage.read(prep / s) for s in STAGES}
    referenced: set[Path] = set()
    needed: dict[str, set[str]] = {s: set() for s in STAGES}
    # The cache units and files of each kept snapshot.
    for name in snapshots_kept:
        folder = root / name
        manifest = _read_json(folder / "manifest.json") or {}
        referenced |= _named_files(manifest, folder)
        needed[manifest.get("stage", "cache")].update(manifest.get("units") or [])
    # The current stage manifests: what the next refresh starts from.
    for stage in STAGES:
        manifest = _read_json(prep / stage / "manifest.json")
        if isinstance(manifest, dict):
            referenced |= _named_files(manifest, prep / stage)
            needed[stage].update(manifest.get("units") or [])
    # Units committed after the newest snapshot: a killed prep's progress, which its re-run resumes from.
    newest = (root / names[-1] / "manifest.json").stat().st_mtime_ns if names else None
    for stage in STAGES:
        for unit_id, mtime in stages[stage].mtimes.items():
            if newest is None or mtime > newest:
                needed[stage].add(unit_id)
    # Lineage: a kept unit's inputs are shards (by sha256) of the stage before it. One producer of each is
    # enough: a kept one when there is one, else the newest (several units can write byte-identical shards,
    # e.g. the same images landing in one bucket from two groupings of the input).
    for index in range(len(STAGES) - 1, 0, -1):
        stage, upstream = STAGES[index], STAGES[index - 1]
        read = sorted({sha for unit_id in needed[stage]
                       for sha in stages[stage].records.get(unit_id, {}).get("inputs") or []})
        for sha in read:
            producers = stages[upstream].by_output.get(sha, [])
            if producers and not needed[upstream].intersection(producers):
                needed[upstream].add(max(producers, key=lambda u: (stages[upstream].mtimes[u], u)))
    remove: dict[str, list[Path]] = {}
    kept_files: dict[str, set[Path]] = {}
    for stage in STAGES:
        stage_root = prep / stage
        keep_here = {p for p in referenced if p.parent in (stage_root, stage_root / "shards")}
        for unit_id in needed[stage]:
            record = stages[stage].records.get(unit_id)
            if record is None:
                continue
            keep_here.add(stage_root / "units" / f"{unit_id}.json")
            keep_here |= _named_files(record, stage_root)
        stems = {p.name.rsplit(".", 1)[0] + "." for p in keep_here if p.parent.name == "shards"}
        candidates = _stage_files(stage_root, stage)
        drop = [p for p in candidates if p not in keep_here and (
            p.name.endswith(".tmp") or not (p.parent.name == "shards" and p.name.startswith(tuple(stems))))]
        # records first: a record whose shard is gone is redone, a shard without a record is only litter
        remove[stage] = sorted(drop, key=lambda p: (p.parent.name != "units", str(p)))
        kept_files[stage] = {p for p in candidates if p not in set(drop)}
    return Plan(keep, snapshots_kept, removed, pinned, remove, kept_files, trash)


def _size(path: Path) -> int:
    try:
        return remotetars.tar_size(path) if path.suffix == ".tar" else path.stat().st_size
    except FileNotFoundError:
        return 0


def _tree_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    return len(files), sum(_size(p) for p in files)


def report_of(plan: Plan, output_dir: str | Path) -> dict[str, Any]:
    """Files and bytes freed and kept, per stage and for the snapshots: what ``gc`` prints and returns."""
    stages = {}
    for stage in STAGES:
        drop = plan.remove[stage]
        stages[stage] = {
            "files": len(drop),
            "bytes": sum(_size(p) for p in drop),
            "unit_records": sum(1 for p in drop if p.parent.name == "units"),
            "shards": sum(1 for p in drop if p.parent.name == "shards"),
            "kept_files": len(plan.kept_files[stage]),
            "kept_bytes": sum(_size(p) for p in plan.kept_files[stage]),
        }
    root = snapshots_dir(output_dir)
    snap_files = snap_bytes = 0
    for folder in [root / n for n in plan.snapshots_removed] + plan.trash:
        count, size = _tree_size(folder)
        snap_files, snap_bytes = snap_files + count, snap_bytes + size
    return {
        "keep": plan.keep,
        "snapshots_kept": plan.snapshots_kept,
        "snapshots_removed": plan.snapshots_removed,
        "pinned": sorted(plan.pinned),
        "stages": stages,
        "snapshots": {"folders": len(plan.snapshots_removed) + len(plan.trash), "files": snap_files,
                      "bytes": snap_bytes},
        "freed_files": sum(s["files"] for s in stages.values()) + snap_files,
        "freed_bytes": sum(s["bytes"] for s in stages.values()) + snap_bytes,
        "kept_bytes": sum(s["kept_bytes"] for s in stages.values()),
    }


def gc(output_dir: str | Path, keep: int, dry_run: bool = False,
       on_busy: Literal["wait", "fail"] = "wait", pins: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Remove every snapshot, unit record and shard that neither the newest ``keep`` snapshots, a pinned
    snapshot nor the current stage manifests reference; return what was (``dry_run``: would be) freed.
    ``pins``: as for :func:`plan_gc`.

    A dry run reads only and takes no lock. A real run holds the writer lock (no prep or compaction runs
    meanwhile), removes dropped snapshots first (renamed out of sight, then deleted), then unit records,
    then shards: a kill at any point leaves every kept snapshot whole, and the next gc finishes.
    """
    output_dir = Path(output_dir)
    if not (snapshots_dir(output_dir) / LATEST).is_file() and not (output_dir / "prep").is_dir():
        raise FileNotFoundError(f"{output_dir} holds no prep output or snapshot: nothing to collect")
    if dry_run:
        return {**report_of(plan_gc(output_dir, keep, pins), output_dir), "dry_run": True}
    removals = KillPoint(PAUSE_ENV, "gc", "removals")
    with writer_lock(output_dir, "gc", on_busy=on_busy):
        with _pins_lock(output_dir):  # no training pins a snapshot while snapshots are chosen and removed
            list_pins(output_dir, drop_stale=True)
            plan = plan_gc(output_dir, keep, pins)
            report = report_of(plan, output_dir)
            root = snapshots_dir(output_dir)
            for name in plan.snapshots_removed:
                os.replace(root / name, root / f"{TRASH}{name}")
                removals.step()
        for folder in sorted(root.glob(f"{TRASH}*")):
            shutil.rmtree(folder, ignore_errors=True)
        for stage in STAGES:
            for path in plan.remove[stage]:
                path.unlink(missing_ok=True)
                removals.step()
            remotetars.forget(plan.remove[stage])  # a store's work folder: those tars go on the store too
    return {**report, "dry_run": False}


def format_report(report: dict[str, Any]) -> str:
    """The table ``latentmill gc`` prints."""
    verb = "would free" if report["dry_run"] else "freed"
    lines = [f"snapshots kept ({len(report['snapshots_kept'])}): {', '.join(report['snapshots_kept']) or '-'}"
             + (f"; pinned: {', '.join(report['pinned'])}" if report["pinned"] else ""),
             f"snapshots removed ({len(report['snapshots_removed'])}): "
             f"{', '.join(report['snapshots_removed']) or '-'}",
             f"{'stage':<9}{'records':>8}{'shards':>8}{'files':>7}{'MB ' + verb:>16}{'files kept':>12}{'MB kept':>10}"]
    for stage, s in report["stages"].items():
        lines.append(f"{stage:<9}{s['unit_records']:>8}{s['shards']:>8}{s['files']:>7}{s['bytes'] / 1e6:>16.3f}"
                     f"{s['kept_files']:>12}{s['kept_bytes'] / 1e6:>10.3f}")
    lines.append(f"total: {verb} {report['freed_files']} files, {report['freed_bytes'] / 1e6:.3f} MB; "
                 f"{report['kept_bytes'] / 1e6:.3f} MB of shards and records kept"
                 + (" (dry run: nothing deleted)" if report["dry_run"] else ""))
    return "\n".join(lines)
