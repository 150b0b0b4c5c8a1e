"""Compaction: merge a cache's small shards into full-size ones by copying their members byte for byte.

Refreshes put their new inputs into new units of their own (a refresh never regroups old inputs), so a year
of small nightly refreshes leaves hundreds of small cache shards. Compaction packs the units whose shards
hold less than ``small_below`` x ``cache.shard_bytes`` into groups of at most ``cache.shard_bytes`` and
writes each group as **the unit the planner asks for next time**: its upstream shards are the concatenation
of the merged units' (``extra.upstream``), its id is :func:`~latentmill.stages.shardio.grouped_unit_id` of
their sha256s, and its record says so. The next prep keeps that group (``previous_unit_groups``), finds its
record and runs nothing.

Nothing is decoded, encoded or captioned: each sample's members are read at the offsets its shard index
gives and written to the new tar unchanged, in the cache unit's own order (bucket, key), so a compacted
unit holds the samples a run of that group would write, in the same order, each member byte-identical to
the one it was. The index of the new shard is written by the same committer as every shard's.

What a kill leaves: the new tars are written as ``.tmp`` and renamed, their records after them, the stage
manifest last. Until the manifest is replaced, the current snapshot and manifest name only the old shards,
which compaction never touches (they stay until ``latentmill gc`` prunes every snapshot that names them). A
re-run finds the merged units already committed and finishes.

Only the cache stage is compacted: it is what every training reads and every rank indexes. The caption,
bucket and ingest stages' refresh units stay as they are (one small shard per refresh and stage, a few
thousand files after years of nightly refreshes, whatever the dataset's size): merging them would change
the shards the next stage's units name, and re-run those units.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from latentmill.stages.killpoint import KillPoint
from latentmill.stages.remotetars import local_tar
from latentmill.stages.shardindex import load_shard_index
from latentmill.stages.shardio import (
    GROUP_KEY,
    ID_KEY,
    StageDir,
    UnitOutput,
    UnitRecord,
    WorkUnit,
    grouped_unit_id,
    shard_bytes,
)

from latentmill.core.config import ConfigError
from latentmill.core.hashing import sha256_file

PAUSE_ENV = "LATENTMILL_COMPACT_PAUSE_AFTER"  # tests: stop after this many samples copied (then get killed)


@dataclass
class CompactionConfig:
    """When a prep compacts the cache on its own (``latentmill compact`` does it on demand)."""

    # A unit is small when its shards hold less than this fraction of cache.shard_bytes.
    small_below: float = 0.5
    # A prep compacts at its end once this many small units are in the cache; 0: never on its own.
    auto_after: int = 8

    def validate(self) -> None:
        if not 0 < self.small_below <= 1:
            raise ConfigError(f"compaction.small_below: a fraction of cache.shard_bytes in (0, 1], got "
                              f"{self.small_below!r}")
        if self.auto_after < 0 or self.auto_after == 1:
            raise ConfigError(f"compaction.auto_after: the number of small units that starts a compaction, "
                              f">= 2, or 0 for never; got {self.auto_after!r}")


def _unit_bytes(stage: StageDir, record: UnitRecord, tar_sizes: Mapping[str, int] | None = None) -> int:
    return sum(shard_bytes(stage.root, s.path, tar_sizes) for s in record.shards)


def _records(stage: StageDir, manifest: dict[str, Any]) -> Iterator[UnitRecord]:
    """The records of the manifest's units, read one at a time (not checked: a merged unit's shards are read
    through their indexes, which are checked then)."""
    for unit_id in manifest.get("units") or []:
        try:
            record = UnitRecord.from_json(json.loads(stage.unit_path(unit_id).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise FileNotFoundError(f"{stage.unit_path(unit_id)}: a unit of {stage.manifest_path} cannot be read "
                                    f"({err}); re-run the prep, which redoes it, then compact") from None
        yield record


def _pack(units: list[UnitRecord], sizes: dict[str, int], target: int) -> list[list[UnitRecord]]:
    """Next fit, in order, into groups of at most ``target`` bytes; groups of one dropped."""
    groups: list[list[UnitRecord]] = []
    current: list[UnitRecord] = []
    size = 0
    for record in units:
        if current and size + sizes[record.unit_id] > target:
            groups.append(current)
            current, size = [], 0
        current.append(record)
        size += sizes[record.unit_id]
    groups.append(current)
    return [g for g in groups if len(g) > 1]


def size_tier(nbytes: int, target: int, factor: int) -> int:
    """0 for a unit within ``1/factor`` of ``target``, 1 for the next ``factor`` times smaller, and so on."""
    tier = 0
    while nbytes * factor ** (tier + 1) < target and tier < 64:
        tier += 1
    return tier


def plan_compaction(stage: StageDir, small_below: float, min_units: int = 2,
                    tar_sizes: Mapping[str, int] | None = None,
                    ) -> tuple[list[list[UnitRecord]], dict[str, Any]]:
    """The groups of small units a compaction would merge (each of two units or more), and what it sees:
    ``{"units", "small_units", "shard_bytes", "small_below"}``.

    Small units (all shards together under ``small_below`` x the manifest's ``shard_bytes``) are taken in
    the order of their first upstream shard's name (the order the planner packs new inputs in) and packed
    next fit into groups of at most ``shard_bytes`` bytes; a group of one is left alone.

    ``min_units`` > 2 (a prep's automatic pass, ``compaction.auto_after``) merges by size tiers: units
    whose sizes are within a factor ``min_units`` of each other (:func:`size_tier`) are merged once
    ``min_units`` of them are there, so a merged unit is merged again only with units about its size. A
    byte is then copied about log_min_units(target / refresh size) times at most, however small the
    refreshes (a merged unit joining every next group would be copied once per compaction).

    ``tar_sizes``: the tars' bytes by path in the stage folder, for a folder without them (an output on a store
    plans from its records and listing, then downloads only the tars it merges).
    """
    manifest = stage.read_manifest()
    target = manifest.get("shard_bytes")
    if not target or "stage_fingerprint" not in manifest:
        raise ValueError(f"{stage.manifest_path} was written before compaction existed (no shard_bytes or "
                         "stage_fingerprint): run `latentmill prep` once with this version, then compact")
    sizes: dict[str, int] = {}
    small = []  # only the small units' records are kept (a whole cache's would grow with its samples)
    for record in _records(stage, manifest):
        sizes[record.unit_id] = _unit_bytes(stage, record, tar_sizes)
        if sizes[record.unit_id] < small_below * target and record.extra.get(GROUP_KEY):
            small.append(record)
    small.sort(key=lambda r: (r.extra[GROUP_KEY][0], r.unit_id))
    seen = {"units": len(sizes), "small_units": len(small), "shard_bytes": target, "small_below": small_below}
    if min_units <= 2:
        return _pack(small, sizes, target), seen
    tiers: dict[int, list[UnitRecord]] = {}
    for record in small:
        tiers.setdefault(size_tier(sizes[record.unit_id], target, min_units), []).append(record)
    groups = [g for tier in sorted(tiers) if len(tiers[tier]) >= min_units for g in _pack(tiers[tier], sizes, target)]
    return groups, seen


def merge_units(stage: StageDir, group: list[UnitRecord], fingerprint: dict[str, Any],
                pause: KillPoint | None = None) -> tuple[UnitRecord, int]:
    """Write the unit that reads every upstream shard of ``group`` (in order) by copying its samples from
    the group's shards; return its record and the member bytes copied (0 when it was already committed)."""
    inputs = [sha for r in group for sha in r.inputs]
    upstream = [name for r in group for name in r.extra[GROUP_KEY]]
    # a member whose id adds to the fingerprint (the VAE tiles of long clips) adds it to the merged unit's, as the
    # planner does for a unit holding any such clip
    added = next((r.extra[ID_KEY] for r in group if r.extra.get(ID_KEY)), None)
    unit = WorkUnit(grouped_unit_id({**fingerprint, **(added or {})}, inputs), inputs,
                    {GROUP_KEY: upstream, **({ID_KEY: added} if added else {})}, sum(r.samples_in for r in group))
    done = stage.load_record(unit.unit_id)
    if done is not None:  # a compaction killed after this unit committed
        return done, 0
    start = time.perf_counter()
    samples = []  # (bucket, key, tar path, members)
    for record in group:
        for shard in record.shards:
            tar = stage.root / shard.path
            index = load_shard_index(tar, shard.index)
            bucket_ids = index.columns["sample_bucket"]
            for i in range(index.num_samples):
                b = int(bucket_ids[i])
                bucket = list(index.buckets[b]) if b >= 0 else shard.bucket
                samples.append((bucket, index.key(i), tar, index.members(i)))
    samples.sort(key=lambda s: (list(s[0] or []), s[1]))  # the cache unit's order: bucket, then key
    stage.ensure()
    out = UnitOutput(stage, unit)
    copied = 0
    fds: dict[Path, int] = {}
    try:
        for bucket, key, tar, members in samples:
            fd = fds.get(tar)
            if fd is None:
                fd = fds[tar] = os.open(local_tar(tar), os.O_RDONLY)
            sample: dict[str, Any] = {"__key__": key}
            for ext, (offset, size) in members.items():
                data = os.pread(fd, size, offset)
                if len(data) != size:
                    raise OSError(f"{tar}: member {key}.{ext} ends past the file ({len(data)} of {size} bytes)")
                sample[ext] = data
                copied += size
            out.add(sample, bucket=bucket)
            if pause is not None:
                pause.step()
        out.quarantined = [q for r in group for q in r.quarantined]
        components: dict[str, Any] = {}
        counts = {"vae": {"encoded": 0, "reused": 0}, "text": {"encoded": 0, "reused": 0}}
        sizes = {"vae": 0, "text": 0}
        for record in group:
            components.update(stage.unit_detail(record).get("components") or {})
            for comp in counts:
                for what in counts[comp]:
                    counts[comp][what] += int(record.extra.get("counts", {}).get(comp, {}).get(what, 0))
                sizes[comp] += int(record.extra.get("bytes", {}).get(comp, 0))
        from latentmill.stages.cache import (
            merged_origins,  # the cache's provenance: device class per component
        )

        out.detail["components"] = components
        out.extra.update(counts=counts, bytes=sizes, **merged_origins(stage, group),
                         compacted_from=[r.unit_id for r in group])
    except BaseException:
        out.abort()
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return out.commit(time.perf_counter() - start), copied


def damaged_shards(stage: StageDir, group: list[UnitRecord]) -> list[dict[str, str]]:
    """The shards of ``group`` whose bytes are not what their records say (sha256), or are missing: a merge
    copies members byte for byte, so it would carry a damaged member into a shard whose own digest is
    fresh, and ``latentmill verify`` would no longer see it. Reads every shard once (compaction reads them
    all anyway; the second read comes from the page cache)."""
    found = []
    for record in group:
        for shard in record.shards:
            tar = stage.root / shard.path
            try:
                ok = sha256_file(local_tar(tar)) == shard.sha256  # a store's tar: downloaded here, merged next
                reason = "its bytes do not match the sha256 its unit record holds"
            except OSError as err:
                ok, reason = False, f"cannot be read: {type(err).__name__}: {err}"
            if not ok:
                found.append({"unit": record.unit_id, "shard": shard.path, "reason": reason})
    return found


def compact_stage(stage: StageDir, small_below: float = 0.5, min_units: int = 2,
                  dry_run: bool = False, tar_sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Merge the stage's small units (:func:`plan_compaction`: all of them with ``min_units`` 2, by size
    tiers of ``min_units`` or more otherwise), and write the stage manifest naming the merged units in their
    place. The caller holds the output_dir's writer lock. Returns what was (``dry_run``: would be) done.
    ``tar_sizes``: as for :func:`plan_compaction` (only the merged units' tars need be in the folder)."""
    start = time.perf_counter()
    groups, seen = plan_compaction(stage, small_below, min_units, tar_sizes)
    merged = [r for g in groups for r in g]
    before = sum(len(r.shards) for r in merged)
    old_tar_bytes = sum(_unit_bytes(stage, r, tar_sizes) for r in merged)
    report: dict[str, Any] = {
        **seen, "groups": len(groups), "merged_units": len(merged), "samples": sum(r.samples_out for r in merged),
        "shards_before": before, "tar_bytes_before": old_tar_bytes, "dry_run": dry_run, "compacted": False,
    }
    if dry_run or not groups:
        return {**report, "seconds": round(time.perf_counter() - start, 3)}
    manifest = stage.read_manifest()
    fingerprint = manifest["stage_fingerprint"]
    # a group with a damaged shard is left as it is (its units stay, `latentmill verify` names the shard)
    damaged = {id(g): found for g in groups if (found := damaged_shards(stage, g))}
    if damaged:
        report["damaged"] = [d for found in damaged.values() for d in found]
        groups = [g for g in groups if id(g) not in damaged]
        merged = [r for g in groups for r in g]
        report.update(groups=len(groups), merged_units=len(merged), samples=sum(r.samples_out for r in merged),
                      shards_before=sum(len(r.shards) for r in merged),
                      tar_bytes_before=sum(_unit_bytes(stage, r, tar_sizes) for r in merged))
        if not groups:
            return {**report, "seconds": round(time.perf_counter() - start, 3)}
    pause = KillPoint(PAUSE_ENV, "compact", "samples")
    replaced = {r.unit_id for r in merged}
    new_records, copied = [], 0
    for group in groups:
        record, nbytes = merge_units(stage, group, fingerprint, pause)
        new_records.append(record)
        copied += nbytes
    header = {k: v for k, v in manifest.items() if k not in ("stage", "shards", "units", "counts")}
    kept = (r for r in _records(stage, manifest) if r.unit_id not in replaced)
    stage.write_manifest(itertools.chain(kept, new_records), header)
    member_bytes = 0
    for record in merged:
        for shard in record.shards:
            member_bytes += int(load_shard_index(stage.root / shard.path, shard.index).columns["member_size"].sum())
    return {
        **report, "compacted": True, "units_written": [r.unit_id for r in new_records],
        "shards_after": sum(len(r.shards) for r in new_records),
        "tar_bytes_after": sum(_unit_bytes(stage, r, tar_sizes) for r in new_records),
        "member_bytes_in_merged_shards": member_bytes, "member_bytes_copied": copied,
        "seconds": round(time.perf_counter() - start, 3),
    }
