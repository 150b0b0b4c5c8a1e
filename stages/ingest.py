"""Ingest: raw media (a folder, a file list, a manifest or webdataset shards) into raw shards with metadata.

Ingest reads headers, not pixels (pixels are decoded once, in the cache stage). Every sample's JSON holds
``key, source`` (its id in the source), ``source_uri`` (what a reader opens), ``sha256`` (of the bytes),
``kind`` (``image`` | ``video``), ``width, height``, the caption found beside it (``sidecar_caption``,
``caption_origin``), and for a video ``fps, frames, duration, codec``. An image keeps its bytes in the
raw shard; a video is a reference: its bytes stay where they are and later stages open ``source_uri``.
Files that are not readable media, or that the recipe does not accept, go to the quarantine list with a
reason. See :mod:`latentmill.stages.sources` for what ``ingest.source`` may name.

Work units are cut by bytes: each holds entries whose estimated shard bytes (the file, a tar header and the
JSON; a video reference only its JSON) stay within ``shard_bytes`` (256 MiB), and at most ``shard_size``
entries (10,000). A first run splits the entries' id-hash range in halves while a range holds too much
(:func:`hash_byte_groups`); later runs keep each entry in the unit it had and put new entries in new units
(:func:`layout`), so a refresh re-runs only the units of new or changed files. Webdataset sources are one
unit per input shard.

Planning streams: the listing goes into a scratch database (:mod:`latentmill.stages.scratch`) and the units
come out of it one at a time, so a plan holds one unit's entries, whatever the size of the source.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from latentmill.stages import pixels
from latentmill.stages.scratch import Scratch
from latentmill.stages.shardio import StageDir, UnitOutput, WorkUnit, check_shard_bytes
from latentmill.stages.sources import (
    REFERENCE_COLUMN,
    REFERENCE_MARK,
    Entry,
    content_identity,
    count_shard_samples,
    is_remote,
    iter_shard_samples,
    list_source,
    read_bytes,
    shard_identity,
    shard_member_uri,
    shard_sample_caption,
    sidecar_caption,
    sidecar_problem,
)
from latentmill.stages.tarshard import TAR_BLOCK
from latentmill.stages.video import VIDEO_EXTENSIONS, probe_video
from PIL import Image, UnidentifiedImageError

from latentmill.core.config import ConfigError
from latentmill.core.filehashes import FileHashes
from latentmill.core.hashing import meta_bytes, sha256_bytes, sha256_file, stable_hash

STAGE = "ingest"
FORMAT_VERSION = 4  # 2: sources, video references, source_uri, caption_origin, hash-grouped units; 3: video
# rotation and variable frame rate (rotation, vfr); 4: every still format, decoding facts (shown size,
# orientation, mode, alpha, colour profile, frames), one image member, images and videos in their own shards
DEFAULT_SHARD_BYTES = 256 << 20  # ingest.shard_bytes
JSON_TAR_BYTES = 4 * TAR_BLOCK  # a sample's json member in a raw shard: header + ~1.5 KB (with a caption)
REMOTE_IMAGE_BYTES = 256 << 10  # a remote image's size is not asked for at planning: this is its estimate
IMAGE_EXTENSIONS = {ext: pixels.IMAGE_MEMBER for ext in pixels.IMAGE_EXTENSIONS}
REFERENCE_MEMBER = "reference"  # an edit pair's source image in a raw shard, and its facts in the json
MEDIA_EXTENSIONS = {**IMAGE_EXTENSIONS, **VIDEO_EXTENSIONS}


@dataclass
class IngestConfig:
    """Where raw media comes from and how it is grouped into shards."""

    source: Optional[str] = None  # folder, file list, manifest, or webdataset shards (stages.sources); required by prep
    shard_bytes: int = DEFAULT_SHARD_BYTES  # target size of a raw shard (= one work unit), estimated at planning
    shard_size: int = 10_000  # and at most this many entries per unit (as img2dataset's shards)
    max_bytes: int = 64 << 20  # larger images are quarantined instead of read (their bytes go into shards)
    max_video_bytes: int = 16 << 30  # larger videos are quarantined (videos are referenced, not copied)
    max_pixels: int = 8192 * 8192  # decompression-bomb guard, checked on the header (per frame for video)
    max_video_seconds: float = 4 * 3600.0  # longer videos are quarantined (probing and scene cuts read all of one)
    extensions: list[str] = field(default_factory=lambda: sorted(MEDIA_EXTENSIONS))
    path_column: Optional[str] = None  # manifest column with the media path or URL (default: path, url)
    caption_column: Optional[str] = "caption"  # manifest column with a caption (absent column: none)
    # An edit dataset: each sample is a target image, its source image and an instruction (the caption);
    # stages.sources' docstring lists the layouts. reference_column: an edit manifest's source column.
    edit: bool = False
    reference_column: Optional[str] = None  # default "source"

    def require_source(self) -> str:
        """``source``, or a ConfigError that says what to set (prep needs it; training alone does not)."""
        if not self.source:
            raise ConfigError("ingest.source: not set; name the media to prepare: a folder, a .txt file list, a "
                              ".csv/.jsonl/.parquet manifest or webdataset shards (e.g. ingest.source=/data/photos)")
        return self.source

    def validate(self) -> None:
        if not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise ConfigError(f"ingest.shard_size: at most this many entries per unit, must be >= 1, got "
                              f"{self.shard_size!r}")
        check_shard_bytes(self.shard_bytes, "ingest.shard_bytes")
        for key in ("max_bytes", "max_video_bytes", "max_pixels"):
            if getattr(self, key) < 1:
                raise ConfigError(f"ingest.{key}: must be >= 1, got {getattr(self, key)}")
        if not self.max_video_seconds > 0:
            raise ConfigError(f"ingest.max_video_seconds: must be > 0, got {self.max_video_seconds}")
        bad = [e for e in self.extensions if e.lower() not in MEDIA_EXTENSIONS]
        if bad:
            raise ConfigError(
                f"ingest.extensions: {bad[0]!r} is not one of {', '.join(sorted(MEDIA_EXTENSIONS))}"
            )


def fingerprint(cfg: IngestConfig) -> dict[str, Any]:
    """What, besides the input bytes, decides ingest's output (the source location does not)."""
    fp = {"stage": STAGE, "version": FORMAT_VERSION, "max_bytes": cfg.max_bytes,
          "max_video_bytes": cfg.max_video_bytes, "max_pixels": cfg.max_pixels,
          "max_video_seconds": cfg.max_video_seconds,
          "extensions": sorted(e.lower() for e in cfg.extensions),
          "path_column": cfg.path_column, "caption_column": cfg.caption_column}
    if cfg.edit:  # (a recipe without edit data keeps its fingerprint, and so its unit ids)
        fp["edit"] = {"reference_column": cfg.reference_column or REFERENCE_COLUMN}
    return fp


def _entry_identity(entry: Entry, hashes: FileHashes | None = None) -> str:
    # Identity = id in the source + bytes of the file, its sidecars and caption; never mtimes, so a fresh
    # clone or a copy of the same data reuses every unit. A video is a reference: its location is part of
    # its output, so a moved video re-ingests (an image's bytes travel in the shard and do not).
    identity = content_identity(entry, hashes)
    return stable_hash([identity, entry.uri]) if entry.suffix in VIDEO_EXTENSIONS else identity


LAYOUT_KEY = "entries"  # a unit record's extra: the ids of the entries the unit held, in order
CUT_KEY = "cut"  # a unit record's extra (and part of its id): [shard_bytes, shard_size] that grouped it
ITEMS_KEY = "items_json"  # an ingest unit's payload: its entries as one JSON string (unit_items)
HASHES_FILE = "file-hashes.sqlite"


def previous_groups(stage_dir: StageDir | None, shard_size: int, shard_bytes: int | None,
                    scratch: Scratch) -> bool:
    """Put the groups of the last committed ingest run into ``scratch``, one unit record at a time (its unit
    id, its entries' ids and identities); whether they are kept.

    None are kept when there is no committed run, when it used another ``shard_size`` (the manifest's) or,
    with ``shard_bytes``, when one of its records was cut with another ``[shard_bytes, shard_size]`` (its
    extra ``cut``; a record from before byte targets has none), or when one of its records predates the
    layout or is missing: then every entry is grouped afresh, as in a first run.
    """
    if stage_dir is None or not stage_dir.manifest_path.is_file():
        return False
    try:
        manifest = stage_dir.read_manifest()
    except (OSError, ValueError):
        return False
    if manifest.get("shard_size") != shard_size:
        return False
    for unit_id in manifest.get("units", []):
        record = stage_dir.load_record(unit_id)
        ids = record.extra.get(LAYOUT_KEY) if record is not None else None
        if not isinstance(ids, list) or (shard_bytes is not None
                                         and record.extra.get(CUT_KEY) != [shard_bytes, shard_size]):
            scratch.clear_previous()
            return False
        scratch.add_previous(record.unit_id, ids, list(record.inputs))
    return True


def stat_signature(members: list[Entry], fp: dict[str, Any], cut: list[int]) -> str | None:
    """A hash of what a unit's id depends on, read from the file system's metadata only: the fingerprint,
    the cut and, per entry, its id, location, caption and the ``(size, mtime_ns, inode)`` of its file and
    sidecars. None when it cannot stand for the content: an entry is remote or its listing failed, a file
    cannot be stat'ed, or one was modified within ``FileHashes.RACY_SECONDS`` (as git's racy rule).

    A refresh that finds a unit's signature remembered (``FileHashes.signature``) takes the unit id and the
    entries' identities from that unit's committed record instead of looking up every file's digest: the
    same ids, from one ``stat`` per file, made when the file is listed (:func:`entry_stat`). It is only an
    accelerator: a fresh clone (other mtimes and inodes) misses it and finds the same ids from the bytes.
    """
    now = time.time()
    return _unit_signature(_signature_head(fp, cut), [entry_stat(e, now)[1] for e in members])


def _signature_head(fp: dict[str, Any], cut: list[int]) -> bytes:
    return stable_hash({"fingerprint": fp, CUT_KEY: cut}).encode()


def _unit_signature(head: bytes, signatures: list[bytes | None]) -> str | None:
    """A unit's signature from its entries' (``entry_stat``), in id order; None when one has none."""
    if not all(signatures):
        return None
    return hashlib.sha256(head + b"".join(signatures)).hexdigest()  # (marshal's bytes delimit themselves)


def _local_files(entry: Entry) -> list[str]:
    """The local files an entry's identity reads: the file, its sidecars, an edit pair's source image."""
    if is_remote(entry.uri):
        return []
    reference = [entry.reference] if entry.reference and not is_remote(entry.reference) else []
    return [entry.uri, *entry.sidecars, *reference]


def entry_stat(entry: Entry, now: float) -> tuple[int, bytes | None, int]:
    """One ``stat`` of each of an entry's local files: its estimated bytes (:func:`entry_bytes`), its share
    of a unit's :func:`stat_signature` (its id, location, caption and stats, marshalled; None when it has
    none; ``now`` is the time racy files are judged against) and how many local files it has."""
    files = _local_files(entry)
    if entry.error or not files or (entry.reference is not None and is_remote(entry.reference)):
        return _estimate(entry, None), None, len(files)
    stats = []
    newest = 0
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            return _estimate(entry, stats[0][0] if stats else 0), None, len(files)
        stats.append((st.st_size, st.st_mtime_ns, st.st_ino))
        newest = max(newest, st.st_mtime_ns)
    size = _estimate(entry, stats[0][0])
    if now - newest / 1e9 < FileHashes.RACY_SECONDS:
        return size, None, len(files)
    # marshal version 2: no back-references, whose use depends on reference counts, so equal rows give equal bytes
    row = (entry.id, entry.uri, entry.caption, entry.sha256, stats, entry.reference)
    return size, marshal.dumps(row, 2), len(files)


def hash_byte_groups(ids: list[str], sizes: list[int] | None, max_size: int,
                     target: int | None = None) -> list[list[int]]:
    """Group ``ids`` (their indices) into id-hash ranges of at most ``max_size`` ids and ``target`` bytes.

    ``sizes[n]`` is the estimated bytes of ``ids[n]``. The 64-bit id hashes (the first 8 bytes of the ids'
    sha256) are split in halves, recursively, while a range holds more than ``max_size`` ids or more than
    ``target`` bytes (one id larger than the target keeps a range of its own); the groups come in ascending
    hash order, each ordered by hash, then index. Adding an id changes only the range it falls into: every other group, and so every other
    unit id, stays as it was (sorted chunking would shift every group after the insertion point). Without
    ``sizes`` (or ``target``) only the count bounds a range. The rule of a plan's first run
    (:meth:`latentmill.stages.scratch.Scratch.groups`), here over a list.
    """
    return layout(ids, [], max_size, sizes, target)


def layout(ids: list[str], previous: list[list[str]], max_size: int, sizes: list[int] | None = None,
           target: int | None = None) -> list[list[int]]:
    """Group entry ``ids`` (their indices) into work units of at most ``max_size`` entries and, with
    ``sizes`` (estimated bytes of each id), at most ``target`` bytes (an entry larger than it: a unit alone).

    Entries keep the unit they had in the ``previous`` run (an entry that is gone leaves its unit one
    smaller), and entries new to this run go into new units of their own: the fewest that keep both limits
    with the new entries, in id-hash order, split evenly by count. A refresh that adds files therefore
    re-runs only units of new files. With no previous run every entry is grouped by
    :func:`hash_byte_groups`, so two clean runs of the same input make the same units. This is the rule
    :func:`plan` streams (:meth:`latentmill.stages.scratch.Scratch.groups`), here over lists.
    """
    with Scratch(memory=True) as scratch:
        scratch.add_entries((i, sizes[n] if sizes is not None else 0, None, None) for n, i in enumerate(ids))
        for group in previous:
            scratch.add_previous(None, group)
        return [[row[0] for row in group] for group in scratch.groups(max_size, target if sizes is not None else None)]


def entry_bytes(entry: Entry) -> int:
    """An entry's estimated bytes in a raw shard: a local image's file size in tar blocks and its json; a
    remote image ``REMOTE_IMAGE_BYTES`` (its size is not asked for); a video (a reference) or an entry that
    will be quarantined only a json. An estimate decides only how entries are grouped, never a shard's bytes.
    """
    return _estimate(entry, None)


def _estimate(entry: Entry, size: int | None) -> int:
    """:func:`entry_bytes`, given the local file's ``size`` (None: stat it when it matters)."""
    if entry.error or entry.suffix not in IMAGE_EXTENSIONS:
        return JSON_TAR_BYTES
    if is_remote(entry.uri):
        size = REMOTE_IMAGE_BYTES
    elif size is None:
        try:
            size = os.stat(entry.uri).st_size
        except OSError:
            size = 0
    return JSON_TAR_BYTES + TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK


def _entry_json(entry: Entry) -> dict[str, Any]:
    """``entry.to_json()`` without ``dataclasses.asdict``'s deep copy (the fields are flat): 10x faster, and
    planning writes one per input."""
    return {**vars(entry), "sidecars": list(entry.sidecars)}


def _packed(entry: Entry) -> bytes:
    """An entry's fields as the scratch database keeps them: marshal is 7x faster than JSON both ways, and the
    bytes never leave this process."""
    return marshal.dumps(tuple(vars(entry).values()))


def _unpacked(data: bytes) -> Entry:
    return Entry(*marshal.loads(data))


def plan(cfg: IngestConfig, stage_dir: StageDir | None = None) -> Iterator[WorkUnit]:
    """Work units of at most ``shard_bytes`` estimated bytes and ``shard_size`` entries, keyed by content
    (see :func:`layout`), one at a time.

    A unit's id is the hash of the ingest fingerprint, the cut ``[shard_bytes, shard_size]`` and its entries'
    content identities, so a unit committed under another cut is never taken for this one. With
    ``stage_dir`` (the ingest stage's folder) planning keeps the last run's grouping and remembers file
    digests in ``<stage_dir>/file-hashes.sqlite``, so an unchanged file is not read again. The listing waits
    in a scratch database (:mod:`latentmill.stages.scratch`: a temporary file, gone when the plan ends or is
    closed).
    """
    source = list_source(cfg.require_source(), cfg.path_column, cfg.caption_column, cfg.edit, cfg.reference_column)
    fp = fingerprint(cfg)
    if source.kind == "webdataset":
        for shard in source.shards:
            ident = [Path(shard).name, shard_identity(shard)]
            if is_remote(shard) or _has_video_member(shard):
                ident.append(shard)  # video samples reference the shard's location
            ids = [stable_hash(ident)]
            unit_id = stable_hash({"fingerprint": fp, "inputs": ids})
            yield WorkUnit(unit_id, ids, {"kind": "shard", "shard": shard}, count_shard_samples(shard))
        return
    with Scratch() as scratch:
        hashes = FileHashes(stage_dir.root / HASHES_FILE if stage_dir is not None else None)
        try:
            yield from _plan_entries(cfg, stage_dir, source, scratch, hashes, fp)
        finally:
            hashes.close()


def _plan_entries(cfg: IngestConfig, stage_dir: StageDir | None, source, scratch: Scratch, hashes: FileHashes,
                  fp: dict[str, Any]) -> Iterator[WorkUnit]:
    """The units of a folder, list or manifest source: its entries streamed into ``scratch``, grouped there,
    and each group read back, identified and written out as one unit.

    Each file is stat'ed once, as it is listed, for its estimated bytes and its share of the unit's
    signature. A group whose signature names a committed unit with the same entries is that unit: its
    entries are not read back, and its files' digests are neither looked up nor named to the store (which
    forgets digests only when it holds more files than were listed)."""
    now, files = time.time(), 0

    def rows() -> Iterator[tuple[str, int, bytes, bytes | None]]:
        nonlocal files
        # Odd files (unknown extensions) are entries too: they get quarantined, so nothing disappears silently.
        for entry in source.iter_entries(scratch):
            size, signature, count = entry_stat(entry, now)
            files += count
            yield entry.id, size, _packed(entry), signature

    scratch.add_entries(rows())
    cut = [cfg.shard_bytes, cfg.shard_size]
    head = _signature_head(fp, cut)
    kept = previous_groups(stage_dir, cfg.shard_size, cfg.shard_bytes, scratch)
    for group in scratch.groups(cfg.shard_size, cfg.shard_bytes):
        if not group:  # new entries each over the byte target split into more pieces than entries
            continue
        group.sort(key=lambda row: row[1])  # by id (stable: an id listed twice keeps its order)
        order = [row[0] for row in group]
        signature = _unit_signature(head, [row[3] for row in group])
        known = hashes.signature(signature) if signature and kept else None  # a unit id of the last run
        record = scratch.previous_unit(known) if known else None
        members, committed = None, False
        if record is not None and record[0] == [row[1] for row in group]:
            unit_id, ids = known, record[1]  # unchanged files: no digest looked up
            committed = True  # (previous_groups read its record, shards and all)
        else:
            members = _members(scratch, order)
            hashes.prefetch([p for e in members for p in _local_files(e)])
            ids = [_entry_identity(e, hashes) for e in members]
            unit_id = stable_hash({"fingerprint": fp, CUT_KEY: cut, "inputs": ids})
        if signature:
            hashes.remember_signature(signature, unit_id)
        payload = {"kind": "entries", "root": source.root, CUT_KEY: cut,
                   "estimated_bytes": sum(row[2] for row in group)}
        if not committed and (stage_dir is None or stage_dir.load_record(unit_id) is None):
            # the entries as one JSON string, read back by the unit (unit_items): one object per unit, not a
            # dict per file; a committed unit never runs, so a refresh writes none for what it reuses
            members = members if members is not None else _members(scratch, order)
            payload[ITEMS_KEY] = json.dumps([_entry_json(e) for e in members])
        yield WorkUnit(unit_id=unit_id, inputs=ids, payload=payload, samples_in=len(order))
    hashes.save(listed=files, list_files=lambda: (
        p for packed in scratch.every_packed() for p in _local_files(_unpacked(packed))))


def _members(scratch: Scratch, order: list[int]) -> list[Entry]:
    """The entries at the listing positions ``order``, in that order."""
    packed = scratch.packed_at(order)
    return [_unpacked(packed[pos]) for pos in order]


def _has_video_member(shard: str) -> bool:
    import tarfile

    with tarfile.open(shard, "r") as tar:
        return any(Path(m.name).suffix.lower() in VIDEO_EXTENSIONS for m in tar if m.isfile())


def _probe_image(data: bytes, cfg: IngestConfig) -> dict[str, Any]:
    """Read an image header, without decoding pixels: format, shown size and decoding facts (stages.pixels)."""
    with pixels.open_image(data) as img:
        facts = pixels.header(img)
        fmt = (img.format or "").lower()
    width, height = facts["width"], facts["height"]
    if width * height > cfg.max_pixels:
        raise ValueError(f"{width}x{height} exceeds ingest.max_pixels={cfg.max_pixels}")
    if width < 1 or height < 1:
        raise ValueError(f"degenerate size {width}x{height}")
    return {**facts, "format": fmt}


class _Refused(Exception):
    """A sample that is quarantined with this message as its reason."""


def _image_header(data: bytes, cfg: IngestConfig) -> dict[str, Any]:
    try:
        return _probe_image(data, cfg)
    except UnidentifiedImageError:
        raise _Refused("not a readable image: unknown format or corrupt header") from None
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise _Refused(f"not a readable image: {err}") from None


def _video_header(src: str | bytes, cfg: IngestConfig) -> dict[str, Any]:
    try:
        header = probe_video(src)
    except ValueError as err:
        reason = str(err)
        prefix = "" if reason.startswith("not a readable video") else "not a readable video: "
        raise _Refused(prefix + reason) from None
    if header["width"] * header["height"] > cfg.max_pixels:
        raise _Refused(f"{header['width']}x{header['height']} exceeds ingest.max_pixels={cfg.max_pixels}")
    if header["duration"] > cfg.max_video_seconds:
        raise _Refused(f"video is {header['duration']:g} s long, over ingest.max_video_seconds="
                       f"{cfg.max_video_seconds:g}; raise it, or cut the video into parts")
    return header


def _check_size(size: int, kind: str, cfg: IngestConfig) -> None:
    limit, key = (cfg.max_bytes, "max_bytes") if kind == "image" else (cfg.max_video_bytes, "max_video_bytes")
    if size == 0:
        raise _Refused("empty file")
    if size > limit:
        raise _Refused(f"file is {size} bytes, over ingest.{key}={limit}")


def _entry_sample(entry: Entry, kind: str, cfg: IngestConfig) -> tuple[dict[str, Any], bytes | None]:
    """Header metadata of one listed entry, and the bytes to store (images only)."""
    limit = cfg.max_bytes if kind == "image" else cfg.max_video_bytes
    if is_remote(entry.uri):
        try:
            data = read_bytes(entry.uri, limit)
        except ValueError:
            raise _Refused(f"file is over ingest.{'max_bytes' if kind == 'image' else 'max_video_bytes'}="
                           f"{limit} bytes") from None
        except Exception as err:  # network and filesystem errors of any fsspec backend
            raise _Refused(f"cannot read {entry.uri}: {type(err).__name__}: {err}") from None
        _check_size(len(data), kind, cfg)
        digest, size, src = sha256_bytes(data), len(data), data
    else:
        path = Path(entry.uri)
        if not path.is_file():
            raise _Refused(f"file not found: {entry.uri}")
        size = path.stat().st_size
        _check_size(size, kind, cfg)
        if kind == "image":
            data = path.read_bytes()
            digest = sha256_bytes(data)
        else:
            data, digest = None, entry.digest or sha256_file(path)  # planning hashed it already
        src = data if kind == "image" else str(path)
    if entry.sha256 and entry.sha256 != digest:
        raise _Refused(f"sha256 mismatch: the manifest says {entry.sha256}, the bytes hash to {digest}")
    header = _image_header(data, cfg) if kind == "image" else _video_header(src, cfg)
    meta = {"sha256": digest, "bytes": size, **header}
    return meta, (data if kind == "image" else None)


def _media_meta(key: str, source: str, root: str, uri: str, kind: str, ext: str, meta: dict[str, Any],
                caption: str | None, origin: str | None) -> dict[str, Any]:
    meta = {"key": key, "source": source, "source_root": root, "source_uri": uri, "kind": kind, **meta,
            "sidecar_caption": caption, "caption_origin": origin}
    if kind == "video":
        meta["format"] = ext
    return meta


def _add(out: UnitOutput, key: str, meta: dict[str, Any], data: bytes | None, reference: bytes | None = None) -> None:
    """Write one raw sample: images and video references go to shards of their own (``part``), so every
    sample of a shard has the same members (``json`` and, for an image, ``image``; an edit pair's source
    image in ``reference``)."""
    sample = {"__key__": key, "json": meta_bytes(meta)}
    if data is not None:
        sample[pixels.IMAGE_MEMBER] = data
    if reference is not None:
        sample[REFERENCE_MEMBER] = reference
    out.add(sample, part=meta["kind"])


def _reference_sample(entry: Entry, kind: str, cfg: IngestConfig) -> tuple[dict[str, Any], bytes]:
    """An edit pair's source image: its header facts (as the json's ``reference``) and its bytes; refused,
    naming the pair, when the target is not an image or the source image is missing or unreadable."""
    if kind != "image":
        raise _Refused("edit pair: the target is a video; edit datasets pair images")
    if entry.reference is None:
        raise _Refused(f"edit pair: no source image for {entry.id} ({Path(entry.id).stem}{REFERENCE_MARK}.<ext> "
                       f"beside it, the same name under source/, or the manifest's "
                       f"{cfg.reference_column or REFERENCE_COLUMN} column)")
    try:
        header, data = _entry_sample(Entry(entry.id, entry.reference), "image", cfg)
    except _Refused as why:
        raise _Refused(f"edit pair: source image {entry.reference}: {why}") from None
    return {"source_uri": entry.reference, **header}, data


def unit_items(unit: WorkUnit) -> list[dict[str, Any]]:
    """The entries (``Entry.to_json()`` each) of an ingest unit of files, in order."""
    if ITEMS_KEY not in unit.payload:
        raise RuntimeError(f"ingest unit {unit.unit_id} was planned as committed, and its record is gone: run "
                           "the prep again")
    return json.loads(unit.payload[ITEMS_KEY])


def _process_entries(cfg: IngestConfig, unit: WorkUnit, out: UnitOutput) -> None:
    accepted = {e.lower() for e in cfg.extensions}
    root = unit.payload["root"]
    items = unit_items(unit)
    out.extra[LAYOUT_KEY] = [item["id"] for item in items]
    if CUT_KEY in unit.payload:
        out.extra[CUT_KEY] = list(unit.payload[CUT_KEY])
    for item in items:
        entry = Entry.from_json(item)
        key = sha256_bytes(entry.id.encode())[:16]
        suffix = entry.suffix
        if entry.error:
            out.quarantine(key, entry.id, entry.error)
            continue
        if suffix not in accepted:
            out.quarantine(key, entry.id, f"unsupported file type {suffix or '(none)'}; accepted: "
                           + ", ".join(sorted(accepted)))
            continue
        kind = "video" if suffix in VIDEO_EXTENSIONS else "image"
        try:
            header, data = _entry_sample(entry, kind, cfg)
            reference = _reference_sample(entry, kind, cfg) if cfg.edit else None
        except _Refused as why:
            out.quarantine(key, entry.id, str(why))
            continue
        caption, origin = (entry.caption, entry.caption_origin) if entry.caption else sidecar_caption(entry.sidecars)
        meta = _media_meta(key, entry.id, root, entry.uri, kind, MEDIA_EXTENSIONS[suffix], header, caption, origin)
        if caption is None and entry.sidecars:
            meta["sidecar_problem"] = sidecar_problem(entry.sidecars)
        if reference is not None:
            meta[REFERENCE_MEMBER] = reference[0]
        _add(out, key, meta, data, reference[1] if reference is not None else None)


def _process_shard(cfg: IngestConfig, unit: WorkUnit, out: UnitOutput) -> None:
    accepted = {e.lower() for e in cfg.extensions}
    shard = unit.payload["shard"]
    name = Path(shard).name
    count = 0
    for sample in iter_shard_samples(shard):
        count += 1
        exts = [e for e in sample["__members__"] if "." + e in MEDIA_EXTENSIONS and "." + e in accepted]
        if pixels.IMAGE_MEMBER in sample["__members__"] and accepted & IMAGE_EXTENSIONS.keys():
            exts.insert(0, pixels.IMAGE_MEMBER)  # a shard latentmill wrote: the one image member
        ext = next((e for e in exts if e == pixels.IMAGE_MEMBER or "." + e in IMAGE_EXTENSIONS),
                   exts[0] if exts else None)
        source = f"{name}/{sample['__key__']}" + (f".{ext}" if ext else "")
        key = sha256_bytes(source.encode())[:16]
        if ext is None:
            have = ", ".join(sorted(sample["__members__"]))
            out.quarantine(key, source, f"no media member with an accepted extension (members: {have})")
            continue
        data = sample[ext]
        kind = "video" if "." + ext in VIDEO_EXTENSIONS else "image"
        store_ext = pixels.IMAGE_MEMBER if kind == "image" else MEDIA_EXTENSIONS["." + ext]
        uri = shard_member_uri(shard, sample["__members__"][ext])
        try:
            _check_size(len(data), kind, cfg)
            header = _image_header(data, cfg) if kind == "image" else _video_header(data, cfg)
        except _Refused as why:
            out.quarantine(key, source, str(why))
            continue
        caption, origin = shard_sample_caption(sample)
        meta = _media_meta(key, source, shard, uri, kind, store_ext,
                           {"sha256": sha256_bytes(data), "bytes": len(data), **header}, caption, origin)
        _add(out, key, meta, data if kind == "image" else None)
    unit.samples_in = count  # plan cannot count a remote shard's samples without reading it


def process(cfg: IngestConfig, unit: WorkUnit, out: UnitOutput) -> None:
    """Read each entry (or shard sample) of the unit; write raw samples or quarantine them with a reason."""
    if unit.payload.get("kind") == "shard":
        _process_shard(cfg, unit, out)
    else:
        _process_entries(cfg, unit, out)


def run(cfg: IngestConfig, stage_dir: StageDir, units: Iterable[WorkUnit] | None = None):
    """Run every unit in this process (the Prefect flow maps ``process`` over units instead)."""
    units = plan(cfg) if units is None else units
    return [stage_dir.run_unit(u, lambda unit, out: process(cfg, unit, out)) for u in units]
