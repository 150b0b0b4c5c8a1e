"""Ingest's plan streams (issue 31, item 1): its units are the units of the list-based plan it replaced (the
reference below: every entry listed into memory, grouped by lists), on a first run and on a refresh, and
the memory it holds does not grow with the number of files."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tracemalloc
from pathlib import Path

from latentmill.stages import ingest
from latentmill.stages.ingest import (
    CUT_KEY,
    ITEMS_KEY,
    LAYOUT_KEY,
    IngestConfig,
    entry_bytes,
    fingerprint,
    layout,
)
from latentmill.stages.shardio import StageDir
from latentmill.stages.sources import Entry, content_identity

from latentmill.core.filehashes import FileHashes
from latentmill.core.hashing import stable_hash

OLD = 1_700_000_000_000_000_000  # long ago: outside FileHashes' racy window, so signatures are remembered


# ---------------------------------------------------------------------------------------------------------
# The list-based reference: the grouping rule and the plan as they were before planning streamed
# ---------------------------------------------------------------------------------------------------------


def _ref_hash_byte_groups(ids, sizes, max_size, target=None):
    keyed = sorted((int(hashlib.sha256(i.encode()).hexdigest()[:16], 16), n, sizes[n] if sizes is not None else 0)
                   for n, i in enumerate(ids))
    limit = target if (target is not None and sizes is not None) else None
    groups = []

    def split(items, lo, bits):
        if not items:
            return
        too_big = len(items) > max_size or (limit is not None and len(items) > 1 and sum(x[2] for x in items) > limit)
        if not too_big or bits == 0:
            groups.append([n for _, n, _ in items])
            return
        mid = lo + (1 << (bits - 1))
        split([x for x in items if x[0] < mid], lo, bits - 1)
        split([x for x in items if x[0] >= mid], mid, bits - 1)

    split(keyed, 0, 64)
    return groups


def _ref_layout(ids, previous, max_size, sizes=None, target=None):
    where = {i: n for n, i in enumerate(ids)}
    groups, placed = [], set()
    for group in previous:
        members = [where[i] for i in group if i in where and i not in placed]
        placed.update(ids[n] for n in members)
        if members:
            groups.append(members)
    new = [n for n, i in enumerate(ids) if i not in placed]
    if not groups:
        return _ref_hash_byte_groups(ids, sizes, max_size, target)
    if new:
        new.sort(key=lambda n: hashlib.sha256(ids[n].encode()).digest())
        count = -(-len(new) // max_size)
        if sizes is not None and target is not None:
            count = max(count, -(-sum(sizes[n] for n in new) // target))
        while True:
            pieces = [new[k * len(new) // count:(k + 1) * len(new) // count] for k in range(count)]
            if sizes is None or target is None or count >= len(new) or all(
                    len(p) == 1 or sum(sizes[n] for n in p) <= target for p in pieces):
                break
            count += 1
        groups += pieces
    return groups


def _ref_listing(root: Path) -> list[Entry]:
    """A folder's entries by their definition: visible files in path order, sidecars beside them."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts) or path.suffix in (".txt", ".json"):
            continue
        sidecars = tuple(str(p) for ext in (".txt", ".json") if (p := path.with_suffix(ext)).is_file())
        out.append(Entry(rel.as_posix(), str(path), sidecars=sidecars))
    return out


def _ref_previous(sd: StageDir, cfg: IngestConfig) -> list:
    if not sd.manifest_path.is_file() or sd.read_manifest().get("shard_size") != cfg.shard_size:
        return []
    records = [sd.load_record(u) for u in sd.read_manifest()["units"]]
    if any(r is None or not isinstance(r.extra.get(LAYOUT_KEY), list)
           or r.extra.get(CUT_KEY) != [cfg.shard_bytes, cfg.shard_size] for r in records):
        return []
    return records


def _ref_plan(cfg: IngestConfig, sd: StageDir) -> list:
    """``ingest.plan`` of a folder as it was: every entry, size and previous record in memory at once."""
    root = Path(cfg.source).resolve()
    entries, fp, cut = _ref_listing(root), fingerprint(cfg), [cfg.shard_bytes, cfg.shard_size]
    hashes = FileHashes(sd.root / ingest.HASHES_FILE)
    sizes = [entry_bytes(e) for e in entries]
    records = _ref_previous(sd, cfg)
    by_id = {r.unit_id: r for r in records}
    units = []
    for group in _ref_layout([e.id for e in entries], [r.extra[LAYOUT_KEY] for r in records], cfg.shard_size,
                             sizes, cfg.shard_bytes):
        members = sorted((entries[i] for i in group), key=lambda e: e.id)
        paths = [p for e in members for p in (e.uri, *e.sidecars)]
        signature = ingest.stat_signature(members, fp, cut)
        record = by_id.get(hashes.signature(signature)) if signature else None
        if record is not None and record.extra.get(LAYOUT_KEY) == [e.id for e in members]:
            unit_id, ids = record.unit_id, list(record.inputs)
            hashes.touch(paths)
        else:
            hashes.prefetch(paths)
            ids = [content_identity(e, hashes) for e in members]  # no videos here: the identity is the content's
            unit_id = stable_hash({"fingerprint": fp, CUT_KEY: cut, "inputs": ids})
        if signature:
            hashes.remember_signature(signature, unit_id)
        items = json.dumps([{**vars(e), "sidecars": list(e.sidecars)} for e in members])
        payload = {"kind": "entries", "root": str(root), ITEMS_KEY: items, CUT_KEY: cut,
                   "estimated_bytes": sum(sizes[i] for i in group)}
        units.append((unit_id, ids, payload, len(members)))
    hashes.save()
    hashes.close()
    return units


# ---------------------------------------------------------------------------------------------------------
# Equality
# ---------------------------------------------------------------------------------------------------------


def test_the_grouping_rule_is_the_list_rule():
    """``layout`` and ``hash_byte_groups`` (the streamed rule over an in-memory table) group as the lists did:
    first runs, refreshes with gone, repeated and new ids, byte targets that leave empty pieces."""
    rng = random.Random(3)
    for trial in range(60):
        n = rng.randrange(0, 400)
        ids = [f"d{rng.randrange(5)}/f{rng.randrange(10**6)}.jpg" for _ in range(n)]
        if trial % 5 == 0 and ids:
            ids += rng.sample(ids, min(3, len(ids)))  # ids listed twice (only odd listings make them)
        sizes = [rng.choice([1, 100, 5000, 40000]) for _ in ids] if trial % 3 else None
        max_size, target = rng.choice([1, 3, 16, 64, 1000]), rng.choice([None, 4096, 50_000])
        assert ingest.hash_byte_groups(ids, sizes, max_size, target) == _ref_hash_byte_groups(ids, sizes, max_size,
                                                                                              target)
        shuffled = ids[:]
        rng.shuffle(shuffled)
        previous = [shuffled[k:k + rng.randrange(1, 30)] + ["gone"] * (k % 2) for k in range(0, len(shuffled) // 2, 20)]
        if trial % 7 == 0 and previous:
            previous[-1] = previous[-1] + previous[0][:2]  # an id an earlier group took
        assert layout(ids, previous, max_size, sizes, target) == _ref_layout(ids, previous, max_size, sizes, target)


def _tree(root: Path, names: list[str], rng: random.Random) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(rng.getrandbits(8) for _ in range(rng.choice([4, 4, 700, 3000]))))
        os.utime(path, ns=(OLD, OLD))
        if rng.random() < 0.2:
            sidecar = path.with_suffix(rng.choice([".txt", ".json"]))
            sidecar.write_text(f"caption of {name}")
            os.utime(sidecar, ns=(OLD, OLD))


def _plans(cfg: IngestConfig, sd: StageDir, tmp_path: Path, name: str):
    """The streamed plan and the reference plan, each against its own copy of the stage folder."""
    ref = StageDir(tmp_path / name, "ingest")
    shutil.copytree(sd.root, ref.root)
    expected = _ref_plan(cfg, ref)
    # a unit found committed carries no entries: it never runs (a refresh pays nothing per reused sample)
    expected = [(uid, inputs, {k: v for k, v in payload.items()
                               if not (k == ingest.ITEMS_KEY and sd.load_record(uid) is not None)}, n)
                for uid, inputs, payload, n in expected]
    got = [(u.unit_id, u.inputs, u.payload, u.samples_in) for u in ingest.plan(cfg, sd)]
    return got, expected


def test_a_streamed_plan_is_the_list_plan_first_and_on_refresh(tmp_path):
    rng = random.Random(11)
    src = tmp_path / "src"
    names = [f"{rng.choice(['', 'a/', 'a/b/', 'c/', 'c-d/'])}f{i:05d}{rng.choice(['.jpg', '.png', '.bin', ''])}"
             for i in rng.sample(range(100_000), 3000)]
    _tree(src, names, rng)
    cfg = IngestConfig(source=str(src), shard_size=50, shard_bytes=64 << 10)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    got, expected = _plans(cfg, sd, tmp_path, "ref-first")
    assert len(got) > 50 and got == expected
    units = list(ingest.plan(cfg, sd))
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in units]
    sd.write_manifest(records, {"shard_size": cfg.shard_size})

    # a refresh: new files, a removed one, a changed one; kept groups, new pieces, remembered signatures
    _tree(src, [f"new/n{i:04d}.jpg" for i in range(300)], rng)
    (src / names[0]).unlink()
    (src / names[1]).write_bytes(b"changed")
    os.utime(src / names[1], ns=(OLD + 10**9, OLD + 10**9))
    got, expected = _plans(cfg, sd, tmp_path, "ref-refresh")
    assert got == expected
    kept = {u[0] for u in got} & {u.unit_id for u in units}
    assert all((ingest.ITEMS_KEY in payload) == (uid not in kept) for uid, _, payload, _ in got)
    assert len(units) - 3 <= len(kept) < len(units) and len(got) > len(units)


# ---------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------


def _peak_of_plan(tmp_path: Path, count: int) -> int:
    """The peak traced Python memory of consuming a first plan of ``count`` 4-byte files (units not kept)."""
    src = tmp_path / f"src-{count}"
    for i in range(count):
        path = src / f"d{i % 5}" / f"f{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"abcd")
        os.utime(path, ns=(OLD, OLD))
    sd = StageDir(tmp_path / f"ingest-{count}", "ingest").ensure()
    cfg = IngestConfig(source=str(src), shard_size=64)
    tracemalloc.start()
    try:
        planned = sum(unit.samples_in for unit in ingest.plan(cfg, sd))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert planned == count
    return peak


def test_a_plans_memory_does_not_grow_with_the_files(tmp_path):
    """Planning holds one unit and per-unit bookkeeping: the peak grows by well under 150 bytes per added file
    (the list-based plan grew by over 1 KB). Both sizes are over ``FileHashes.FLUSH_ROWS``, so its buffers are
    full in both."""
    small, large = 2500, 10_000
    assert FileHashes.FLUSH_ROWS < small
    per_file = (_peak_of_plan(tmp_path, large) - _peak_of_plan(tmp_path, small)) / (large - small)
    assert per_file < 150, per_file


def test_a_refresh_of_entries_over_the_byte_target_plans_no_empty_unit(tmp_path):
    """New entries each larger than ``ingest.shard_bytes`` are split into more pieces than there are entries;
    the empty pieces are not units (they were: samples_in 0, all of one id)."""
    src = tmp_path / "src"
    _tree(src, [f"f{i:03d}.jpg" for i in range(6)], random.Random(3))
    cfg = IngestConfig(source=str(src), shard_size=50, shard_bytes=1)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg, sd)]
    sd.write_manifest(records, {"shard_size": cfg.shard_size})
    _tree(src, [f"new{i}.jpg" for i in range(3)], random.Random(4))
    units = list(ingest.plan(cfg, sd))
    assert sum(u.samples_in for u in units) == 9 and all(u.samples_in == 1 for u in units)
    assert len({u.unit_id for u in units}) == len(units) == 9
