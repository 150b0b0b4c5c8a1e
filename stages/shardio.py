"""Shard I/O shared by every stage: deterministic webdataset tars, atomic commits, unit records, manifests.

Layout of one stage under ``<output_dir>/prep/<stage>/``::

    shards/<stage>-<unit id>-<part>.tar   webdataset tars, written as .tmp and renamed when complete
    shards/<stage>-<unit id>-detail.json  a unit's per-sample facts (score or component keys)
    units/<unit id>.json                  what one work unit produced (shards, quarantine), written last
    ../catalog.sqlite                     the keys later units look up, one catalog per output folder
    manifest.json                         the stage's current output: every shard, counts, fingerprint
    quarantine.jsonl                      every sample the stage refused, with the reason

A work unit's id is the hash of its inputs' content and the stage fingerprint (contract 1), so a unit
whose record exists is done: re-running reuses it, and a killed run resumes at the first missing unit.

This module is the stages' bookkeeping over shards: writing a unit's shards (``ShardSink``, a tar and its
index together), unit records, manifests, sample iteration and unit planning. The layers beneath it, each
importing nothing from here: ``tarshard`` (the tar format: member headers, reading samples, the header
scan), ``shardindex`` (the ``.idx`` file beside each tar), ``hashing`` (content hashes, canonical JSON) and
``catalog`` (the scores, embeddings and components that units look up, rows written in each unit's commit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tarfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from latentmill.stages.catalog import DETAIL_KEY, Catalog, Lookup, catalog_path, unit_detail
from latentmill.stages.remotetars import held, tar_size
from latentmill.stages.shardindex import bucket_of, build_shard_index, index_tar, write_index_file
from latentmill.stages.tarshard import (
    MAX_HEADER,
    TAR_BLOCK,
    group_samples,
    read_shard,
    tar_bytes,
    tar_member_header,
)

from latentmill.core import durable
from latentmill.core.config import ConfigError
from latentmill.core.hashing import json_bytes, sha256_file, stable_hash

FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------------------
# Writing one shard: its tar and, beside it, its index
# ---------------------------------------------------------------------------------------------------------


class ShardSink:
    """Writes samples into ``path`` through a temporary file; ``commit`` renames it into place.

    The tar is what ``webdataset.TarWriter(user=group=_TAR_USER, mtime=0, encoder=False)`` writes over a
    ``tarfile`` stream, byte for byte (tests/test_shardio.py compares them): per sample its members in sorted
    extension order, each a header (:func:`tar_member_header`) and its data padded to 512 bytes; at the end
    two zero blocks, then zeros to a multiple of 10 KiB. Written here directly: the stream and ``TarFile``
    layers cost more than the header itself. mtime 0 and a fixed owner make the bytes a pure function of the
    samples; written front to back, hashing the writes hashes the file. Where each member's data lands is
    known as it is written, so the shard index is built from it too, its members grouped into samples by the
    readers' own rule (``tarshard.group_samples``; :func:`index_tar` reads the tar back only for names that
    need a pax header).
    """

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self._fh = open(self.tmp, "wb")
        self._sha = hashlib.sha256()
        self._offset = 0  # bytes written
        self.count = 0
        self.size = 2 * TAR_BLOCK  # the tar's bytes once closed (before its last record is padded)
        self.index: dict[str, Any] | None = None  # the index's manifest entry, set by ``commit``
        # (name, (data offset, size, what the index reads of it)) of every member written, for the index: a
        # json member's bytes (its sample's bucket), a safetensors member's header (None: read the tar back)
        self._members: list[tuple[str, tuple[int, int, bytes | None]]] | None = []

    def _put(self, data: bytes) -> None:
        self._sha.update(data)
        self._fh.write(data)
        self._offset += len(data)

    def write(self, sample: dict[str, Any]) -> None:
        if "__key__" not in sample:
            raise ValueError("object must contain a __key__")
        for k, v in sample.items():
            if k[0] != "_" and not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} doesn't map to a bytes after encoding ({type(v)})")
        key = sample["__key__"]
        for ext in sorted(sample):
            if ext[0] == "_":  # __key__ and other metadata entries are not written
                continue
            data = sample[ext]
            name = f"{key}.{ext}"
            size = len(data)
            header = tar_member_header(name, size)
            self._put(header)
            data_at = self._offset
            self._put(data)
            if size % TAR_BLOCK:
                self._put(bytes(TAR_BLOCK - size % TAR_BLOCK))
            self._remember(name, data_at, data, len(header) == TAR_BLOCK)
        self.count += 1
        self.size += tar_bytes(sample)

    def _remember(self, name: str, data_at: int, data: bytes, plain: bool) -> None:
        """Note one member for the index: where its data lies, and the bytes the index reads of it."""
        if self._members is None:
            return
        if not plain:  # a pax header: let index_tar read the name back as tarfile does
            self._members = None
            return
        size, read = len(data), None
        if name.endswith(".json"):
            read = bytes(data)
        elif name.endswith(".safetensors") and size >= 8:
            length = int.from_bytes(bytes(data[:8]), "little")
            if 8 + length <= size and length <= MAX_HEADER:
                read = bytes(data[8:8 + length])
        self._members.append((name, (data_at, size, read)))

    def _finish_tar(self) -> None:
        """The end of the archive, as ``TarFile.close`` writes it: two zero blocks, then a full record."""
        self._put(bytes(2 * TAR_BLOCK))
        if self._offset % tarfile.RECORDSIZE:
            self._put(bytes(tarfile.RECORDSIZE - self._offset % tarfile.RECORDSIZE))

    def commit(self) -> str:
        """Finish the tar, move it into place, write its index beside it (built from what was written, else
        ``index_tar``: from the tar's bytes, read back from the page cache); return the tar's sha256."""
        self._finish_tar()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if self._members is not None:
            samples, headers, buckets = [], {}, []
            for key, members in group_samples(self._members, str(self.path)):
                samples.append((key, {ext: (at, size) for ext, (at, size, _) in members.items()}))
                headers.update({(len(samples) - 1, ext): read for ext, (_, _, read) in members.items()
                                if read is not None and ext.endswith(".safetensors")})
                meta = members.get("json")
                buckets.append(bucket_of(meta[2]) if meta is not None else None)
            data = build_shard_index(self._offset, samples, headers, buckets)
        else:
            data = index_tar(self.tmp)
        durable.replace(self.tmp, self.path)
        self.index = write_index_file(self.path, data)
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._fh.close()
        self.tmp.unlink(missing_ok=True)


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
    bucket: list[int] | None = None  # the bucket of every sample; null for a shard of several buckets
    index: dict[str, Any] | None = None  # the shard index beside the tar: {"name", "size", "sha256"}
    buckets: dict[str, int] | None = None  # samples per bucket ("WxHxF"), for a shard of several buckets


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
        """The record as written (``reused`` is not), sharing ``extra`` and ``quarantined`` with the record:
        ``dataclasses.asdict`` would deep-copy them (a curate record holds every sample's score keys) only
        for them to be encoded."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "reused"}
        data["shards"] = [asdict(shard) for shard in self.shards]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "UnitRecord":
        data = dict(data)
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        return cls(**data)

    def to_json_held(self) -> dict[str, Any]:
        """:meth:`to_json` with ``reused`` (a record held in memory, not written)."""
        return {**self.to_json(), "reused": self.reused}


@dataclass
class WorkUnit:
    """A stage's unit of work: its id (content hash + fingerprint) and what it reads."""

    unit_id: str
    inputs: list[str]  # input identities (content hashes), for the record
    payload: dict[str, Any]  # stage-specific description: input shard paths, file lists, bucket...
    samples_in: int

    def to_json(self) -> list[Any]:
        return [self.unit_id, self.inputs, self.payload, self.samples_in]

    @classmethod
    def from_json(cls, data: list[Any]) -> "WorkUnit":
        return cls(*data)


_MIXED = "mixed"  # a shard's bucket once two samples of different buckets went into it


class UnitOutput:
    """Collects one unit's samples into shards (one per ``part``) and its quarantine entries.

    A unit planned by :func:`units_by_bytes` writes one shard per part, holding every bucket it meets (each
    sample's bucket is in its ``json`` and in the shard index; the shard's ``bucket`` is null when it holds
    several). A unit whose estimated output passes its byte target (one upstream shard larger than the
    target) gets ``payload["roll_bytes"]``: a part then continues in a new shard (``<part>-1``,
    ``<part>-2``...) before a sample that would take the current one past that many bytes (before the tar's
    last record is padded to 10 KiB). Where the cut falls
    depends only on the samples' bytes and order, so it is the same whichever runner wrote the unit.
    """

    def __init__(self, stage_dir: "StageDir", unit: WorkUnit):
        self.stage_dir = stage_dir
        self.unit = unit
        self._sinks: dict[tuple[str, int], ShardSink] = {}
        self._open: dict[str, int] = {}  # part -> the number of its shard now written
        self._buckets: dict[tuple[str, int], Any] = {}
        self._counts: dict[tuple[str, int], dict[str, int]] = {}
        self.roll_bytes: int | None = unit.payload.get("roll_bytes")
        self.quarantined: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        # per-sample facts (curate's score rows, the cache's component keys) go in a file of their own, so
        # that every pass over a stage's records (plan, manifest, reports) costs per unit, not per sample
        self.detail: dict[str, Any] = {}
        if "upstream" in unit.payload:
            self.extra[GROUP_KEY] = list(unit.payload["upstream"])
        if ID_KEY in unit.payload:
            self.extra[ID_KEY] = dict(unit.payload[ID_KEY])

    def add(self, sample: dict[str, Any], part: str = "0", bucket: list[int] | None = None) -> None:
        """Append ``sample`` to the shard ``part`` of this unit (e.g. one part per kind of sample)."""
        seq = self._open.get(part, 0)
        sink = self._sinks.get((part, seq))
        if sink is not None and self.roll_bytes and sink.count and \
                sink.size + tar_bytes(sample) > self.roll_bytes:
            seq = self._open[part] = seq + 1
            sink = None
        if sink is None:
            suffix = part if seq == 0 else f"{part}-{seq}"
            name = f"{self.stage_dir.stage}-{self.unit.unit_id[:16]}-{suffix}.tar"
            sink = self._sinks[(part, seq)] = ShardSink(self.stage_dir.shard_dir / name)
            self._buckets[(part, seq)] = bucket
            self._open[part] = seq
        elif self._buckets[(part, seq)] != bucket:
            self._buckets[(part, seq)] = _MIXED
        if bucket is not None:
            counts = self._counts.setdefault((part, seq), {})
            name = "x".join(map(str, bucket))
            counts[name] = counts.get(name, 0) + 1
        sink.write(sample)

    def quarantine(self, key: str, source: str, reason: str, **details: Any) -> None:
        """Refuse one sample, keeping where it came from and why (``details``: more JSON fields of the entry,
        e.g. the curate stage's ``scores`` or ``duplicate_of``)."""
        self.quarantined.append({"key": key, "source": source, "stage": self.stage_dir.stage, "reason": reason,
                                 **details})

    def commit(self, seconds: float) -> UnitRecord:
        shards = []
        for part in sorted(self._sinks):
            sink = self._sinks[part]
            digest = sink.commit()
            bucket = self._buckets[part]
            shards.append(
                ShardInfo(
                    name=sink.path.name,
                    path=f"shards/{sink.path.name}",
                    sha256=digest,
                    samples=sink.count,
                    bucket=None if bucket is _MIXED else bucket,
                    index=sink.index,
                    buckets=dict(sorted(self._counts[part].items())) if bucket is _MIXED else None,
                )
            )
        if self.detail:
            name = f"{self.stage_dir.stage}-{self.unit.unit_id[:16]}-detail.json"
            durable.write_json(self.stage_dir.shard_dir / name, self.detail, indent=None)
            self.extra[DETAIL_KEY] = f"shards/{name}"
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
        path = self.stage_dir.unit_path(self.unit.unit_id)
        data = record.to_json()
        durable.write_json(path, data)
        # without a detail file (a unit whose record holds its facts), the catalog reads them from the record
        self.stage_dir.catalog.enter(self.stage_dir.stage, data, path.stat().st_mtime_ns, self.detail or None)
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

    @property
    def catalog(self) -> Catalog:
        """The output folder's catalog (``prep/catalog.sqlite``, beside the stage folders)."""
        return Catalog(catalog_path(self.root))

    @contextlib.contextmanager
    def lookup(self) -> Iterator[Lookup]:
        """The catalog, in line with this stage's committed records, for a unit's lookups."""
        catalog = self.catalog
        catalog.sync(self.stage, self.unit_dir)
        with catalog.lookup() as found:
            yield found

    def load_record(self, unit_id: str) -> UnitRecord | None:
        """The unit's record if the unit is complete (record present and every shard on disk or, in the work
        folder of an output on a store, on the store: ``remotetars.held``)."""
        path = self.unit_path(unit_id)
        if not path.is_file():
            return None
        try:
            record = UnitRecord.from_json(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            return None
        if any(not held(self.root / s.path) for s in record.shards):  # a store's work folder: or on the store
            return None
        if DETAIL_KEY in record.extra and not (self.root / record.extra[DETAIL_KEY]).is_file():
            return None
        if not self._ensure_indexes(record):
            return None
        record.reused = True
        return record

    def unit_detail(self, record: UnitRecord) -> dict[str, Any]:
        """The per-sample facts of a committed unit: its detail file, or its record's ``extra`` for a unit
        committed before detail files (``catalog.unit_detail``)."""
        return unit_detail(self.root, record.extra)

    def _ensure_indexes(self, record: UnitRecord) -> bool:
        """Give every shard of a committed unit its index: a unit committed before indexes existed (cache
        format 2), or one whose index file is missing or damaged, gets it written from its tar (a header scan,
        nothing re-encoded) and its record rewritten. False when the rebuilt index differs from the one the
        record names: the tar changed since it was committed, and the unit must run again."""
        changed = False
        for shard in record.shards:
            tar = self.root / shard.path
            if shard.index is not None:
                path = tar.with_name(shard.index["name"])
                try:
                    if path.stat().st_size == shard.index["size"] and sha256_file(path) == shard.index["sha256"]:
                        continue
                except OSError:
                    pass
            entry = write_index_file(tar)
            if shard.index is not None and entry != shard.index:
                return False
            shard.index, changed = entry, True
        if changed:
            durable.write_json(self.unit_path(record.unit_id), record.to_json())
        return True

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
        return out.commit(time.perf_counter() - start)

    def write_manifest(self, records: Iterable[UnitRecord], header: dict[str, Any]) -> dict[str, Any]:
        """Write the stage manifest (last, atomically) and the quarantine list; return the manifest. One pass
        over ``records`` (a :class:`StageRecords` reads them one at a time)."""
        self.ensure()
        shards, units, quarantined = [], [], []
        counts = {"in": 0, "out": 0, "expanded": 0}
        for r in records:
            units.append(r.unit_id)
            shards += [{k: v for k, v in asdict(s).items() if k not in ("index", "buckets") or v is not None}
                       for s in r.shards]
            quarantined += r.quarantined
            counts["in"] += r.samples_in
            counts["out"] += r.samples_out
            counts["expanded"] += int(r.extra.get("expanded", 0))
        expanded = counts.pop("expanded")
        manifest = {
            "stage": self.stage,
            "format_version": FORMAT_VERSION,
            **header,
            "shards": sorted(shards, key=lambda s: s["name"]),
            "units": sorted(units),
            "counts": {
                **counts,
                "quarantined": len(quarantined),
                **({"expanded": expanded} if expanded else {}),  # clips beyond one per video
            },
        }
        durable.write_bytes(self.quarantine_path, b"".join(
            json_bytes(q) + b"\n" for q in sorted(quarantined, key=lambda q: (q["source"], q["key"]))))
        durable.write_json(self.manifest_path, manifest)
        return manifest

    def read_manifest(self) -> dict[str, Any]:
        if not self.manifest_path.is_file():
            raise FileNotFoundError(f"{self.manifest_path} does not exist: run the {self.stage} stage first")
        return json.loads(self.manifest_path.read_text())


class StageRecords:
    """The committed records of a stage's units, read from their files each time they are iterated.

    What a stage's manifest, report and summaries are computed from: each pass holds one record at a time,
    so the per-sample detail of a whole stage (a curate unit's scores, a cache unit's component keys) never
    sits in memory together. Iterated in unit id order; ``reused``: the ids of the units this run found
    committed rather than ran.
    """

    def __init__(self, stage_dir: StageDir, unit_ids: Iterable[str], reused: Iterable[str] = ()):
        self.stage_dir = stage_dir
        self.unit_ids = sorted(set(unit_ids))
        self.reused = set(reused)

    def load(self, unit_id: str) -> UnitRecord:
        """The committed record of one unit, as written (its ``reused`` as this run found it)."""
        path = self.stage_dir.unit_path(unit_id)
        try:
            record = UnitRecord.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: the record of a unit this run committed is gone: was the output "
                                    "folder changed while the prep ran?") from None
        record.reused = unit_id in self.reused
        return record

    def __len__(self) -> int:
        return len(self.unit_ids)

    def __iter__(self) -> Iterator[UnitRecord]:
        return (self.load(unit_id) for unit_id in self.unit_ids)

    def __getitem__(self, i: int) -> UnitRecord:
        return self.load(self.unit_ids[i])


def by_unit_id(records: Iterable[UnitRecord]) -> Iterable[UnitRecord]:
    """``records`` in unit id order: as they are for :class:`StageRecords`, sorted otherwise."""
    return records if isinstance(records, StageRecords) else sorted(records, key=lambda r: r.unit_id)


def stage_report(stage: str, records: list[UnitRecord], seconds: float) -> dict[str, Any]:
    """Counts for the run summary: in + expanded = out + quarantined, and in = processed + reused.

    ``expanded`` is non-zero only where one input sample becomes several outputs (the bucket stage cuts a
    video into clips); its records then count ``videos``, ``clips`` and ``expanded`` (clips beyond the
    first of each video) in ``extra``, and the report carries them. ``in``, ``processed`` and ``reused``
    count input samples; ``out`` counts output samples (clips).
    """
    report = {"in": 0, "out": 0, "quarantined": 0, "processed": 0, "reused": 0, "shards": 0, "units": 0,
              "seconds": round(seconds, 3)}
    videos = clips = expanded = 0
    has_clips = False
    for r in records:  # one pass: a StageRecords reads its records from disk on each
        report["in"] += r.samples_in
        report["out"] += r.samples_out
        report["quarantined"] += len(r.quarantined)
        report["reused" if r.reused else "processed"] += r.samples_in
        report["shards"] += len(r.shards)
        report["units"] += 1
        expanded += int(r.extra.get("expanded", 0))
        videos += int(r.extra.get("videos", 0))
        clips += int(r.extra.get("clips", 0))
        has_clips = has_clips or "clips" in r.extra
    if has_clips:
        report.update(videos=videos, clips=clips, expanded=expanded)
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


# Shard layout of the caption, bucket and cache stages (it joins their unit ids). 1: one unit per upstream
# shard, one shard per (unit x bucket). 2: upstream shards grouped up to a byte target, one shard per unit
# (per kind of sample: image or video) holding every bucket it meets (see docs/cache-format.md).
LAYOUT_VERSION = 2
DEFAULT_SHARD_BYTES = 1 << 30  # cache.shard_bytes
# A unit estimated at E > target bytes cuts its shards at min(target, S * E / n + one sample) with
# n = ceil(S * E / target), S = ROLL_SLACK / 100: n shards of about equal size, each at most the target, with
# room for an estimate up to 10% low (and for whole samples) before an (n+1)th small one is cut.
ROLL_SLACK = 110
GROUP_KEY = "upstream"  # a unit record's extra: the names of the upstream shards the unit read, in order
# a unit record's extra: what its id adds to the stage fingerprint (the cache's VAE tiles of a unit holding long
# clips), so that a compaction gives the merged unit the id the next plan asks for
ID_KEY = "id_fingerprint"


def group_by_bytes(items: list[tuple[str, int]], previous: list[list[str]], target: int) -> list[list[str]]:
    """Group ``items`` (name, estimated output bytes), in the given order, into groups of at most ``target``
    bytes (a single item larger than the target makes a group of its own).

    Stable across refreshes: each group of ``previous`` (the last run's units) keeps those of its members
    that are still listed, in its order, and only the items no previous group holds are packed into new
    groups (next fit, in the order of ``items``). A refresh therefore never regroups old inputs: its new
    inputs form new units, and a removed input changes only the unit that held it.
    """
    listed = dict(items)
    groups: list[list[str]] = []
    placed: set[str] = set()
    for group in previous:
        members = [name for name in group if name in listed and name not in placed]
        placed.update(members)
        if members:
            groups.append(members)
    current: list[str] = []
    size = 0
    for name, nbytes in items:
        if name in placed:
            continue
        if current and size + nbytes > target:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def previous_unit_groups(stage_dir: StageDir | None) -> list[list[str]]:
    """The upstream shard names of each unit of the stage's last committed manifest (empty without one, or
    for units of layout 1, whose records do not name them)."""
    if stage_dir is None or not stage_dir.manifest_path.is_file():
        return []
    try:
        unit_ids = json.loads(stage_dir.manifest_path.read_text()).get("units") or []
    except (OSError, ValueError):
        return []
    groups = []
    for unit_id in unit_ids:
        try:
            names = json.loads(stage_dir.unit_path(unit_id).read_text()).get("extra", {}).get(GROUP_KEY)
        except (OSError, ValueError, AttributeError):
            continue
        if names:
            groups.append(list(names))
    return groups


def shard_tar_bytes(upstream: StageDir, entry: dict[str, Any], per_sample: int = 0) -> int:
    """An upstream shard's size on disk, plus ``per_sample`` bytes a sample: what a stage that copies its
    samples and adds a little to each (a caption, a bucket and crop in its json) writes."""
    return tar_size(upstream.root / entry["path"]) + per_sample * int(entry["samples"])


def copy_estimate(per_sample: int) -> Callable[[StageDir, dict[str, Any]], int]:
    """``shard_tar_bytes`` with ``per_sample`` bytes added to each sample (an estimate for ``units_by_bytes``)."""
    return lambda upstream, entry: shard_tar_bytes(upstream, entry, per_sample)


def grouped_unit_id(fingerprint: dict[str, Any], inputs: list[str]) -> str:
    """The id of a unit that reads the upstream shards of sha256 ``inputs`` (in order), for a stage of
    ``fingerprint``: planning (:func:`units_by_bytes`) and compaction (``stages.compact``) agree on it, so a
    compacted unit is the unit the next plan asks for."""
    return stable_hash({"fingerprint": fingerprint, "layout": LAYOUT_VERSION, "inputs": list(inputs)})


def units_by_bytes(upstream: StageDir, fingerprint: dict[str, Any], target: int,
                   stage_dir: StageDir | None = None,
                   estimate: Callable[[StageDir, dict[str, Any]], int] = shard_tar_bytes) -> list[WorkUnit]:
    """Work units that each read several upstream shards, up to ``target`` estimated output bytes.

    ``estimate(upstream, entry)`` is the output one upstream shard will make. Grouping follows
    :func:`group_by_bytes` (upstream shards in manifest order, i.e. by name; ``stage_dir``'s last manifest
    keeps old groups), so it is deterministic and a refresh adds units only for new upstream shards. A unit's
    id is the hash of its inputs' sha256s (in order), the stage fingerprint and ``LAYOUT_VERSION``. A unit
    whose estimate passes ``target`` (one upstream shard larger than it) cuts its output into shards of about
    equal size, each at most ``target`` bytes (``payload["roll_bytes"]``, see :class:`UnitOutput`).
    """
    entries = {e["name"]: e for e in upstream.read_manifest()["shards"]}
    sizes = {name: int(estimate(upstream, e)) for name, e in entries.items()}
    units = []
    for group in group_by_bytes(list(sizes.items()), previous_unit_groups(stage_dir), target):
        members = [entries[name] for name in group]
        inputs = [e["sha256"] for e in members]
        unit_id = grouped_unit_id(fingerprint, inputs)
        estimated = sum(sizes[name] for name in group)
        payload = {"shards": [str(upstream.root / e["path"]) for e in members], GROUP_KEY: list(group),
                   "estimated_bytes": estimated}
        if estimated > target:  # cut into n shards of about equal size, each at most the target
            n = -(-estimated * ROLL_SLACK // (100 * target))
            per_sample = estimated // max(1, sum(e["samples"] for e in members))
            payload["roll_bytes"] = min(target, -(-estimated * ROLL_SLACK // (100 * n)) + per_sample)
        units.append(WorkUnit(unit_id, inputs, payload, sum(e["samples"] for e in members)))
    return units


def sibling_stage(upstream: StageDir, stage: str) -> StageDir:
    """The folder of ``stage`` beside its upstream stage's (``<output_dir>/prep/<stage>``)."""
    return StageDir(upstream.root.parent / stage, stage)


def check_shard_bytes(value: int, key: str) -> None:
    """Refuse a byte target below 1 (a ``ConfigError`` naming the key)."""
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: the target size of a shard in bytes, must be >= 1, got {value!r}")


def unit_input_shards(unit: WorkUnit) -> list[str]:
    """The upstream shard paths a unit reads (``shards``; ``shard`` in units planned before layout 2)."""
    return list(unit.payload["shards"]) if "shards" in unit.payload else [unit.payload["shard"]]


def iter_unit_samples(unit: WorkUnit) -> Iterator[dict[str, Any]]:
    """Every sample of a unit's upstream shards, shard after shard, in file order."""
    for path in unit_input_shards(unit):
        yield from read_shard(path)


def shard_bytes(stage_root: Path, path: str, sizes: Mapping[str, int] | None = None) -> int:
    """The bytes of the shard ``path`` (relative to its stage folder): ``sizes[path]`` when given there (a work
    folder of an output on a store holds only the tars it reads), else its file's."""
    if sizes is not None and path in sizes:
        return sizes[path]
    return tar_size(stage_root / path)


def shard_buckets(entry: dict[str, Any]) -> dict[str, int]:
    """Samples per bucket (``"WxHxF"``) of one manifest shard entry: its ``bucket`` when it holds one bucket,
    its ``buckets`` when it holds several (layout 2); empty for a shard without buckets (ingest, caption)."""
    if entry.get("bucket"):
        return {"x".join(map(str, entry["bucket"])): int(entry["samples"])}
    return dict(entry.get("buckets") or {})


def units_per_shard(upstream: StageDir, fingerprint: dict[str, Any]) -> list[WorkUnit]:
    """One work unit per upstream shard, keyed by that shard's hash and this stage's fingerprint."""
    units = []
    for shard in upstream.read_manifest()["shards"]:
        unit_id = stable_hash({"fingerprint": fingerprint, "inputs": [shard["sha256"]]})
        payload = {"shard": str(upstream.root / shard["path"]), "bucket": shard.get("bucket")}
        units.append(WorkUnit(unit_id, [shard["sha256"]], payload, shard["samples"]))
    return units
