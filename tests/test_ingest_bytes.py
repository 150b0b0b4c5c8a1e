"""Ingest units cut by bytes (issue 17): ``ingest.shard_bytes`` is the target size of a raw shard, with
``ingest.shard_size`` an upper bound on entries. A refresh keeps old raw shards byte for byte and adds units
for new files only; a removed file re-runs only its unit; a killed run resumes to the same bytes; a bad key
is a ConfigError that names it."""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

import pytest
from latentmill.stages import ingest
from latentmill.stages.ingest import ITEMS_KEY, IngestConfig, unit_items
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from PIL import Image

from latentmill.core.config import ConfigError
from latentmill.recipe import load_recipe
from tests.conftest import DEMO_CONFIG

TARGET = 48 * 1024


def _noise_jpeg(path: Path, side: int, seed: int) -> None:
    """A JPEG of random pixels: its file size grows with ``side`` (~1.5 KB at 24 px, ~25 KB at 96 px)."""
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (side, side), bytes(rng.getrandbits(8) for _ in range(side * side * 3)))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    path.write_bytes(buf.getvalue())


@pytest.fixture()
def photos(tmp_path) -> Path:
    """40 noise JPEGs of 24..96 px (1.5 to 25 KB), each with a caption sidecar."""
    src = tmp_path / "photos"
    src.mkdir()
    for i in range(40):
        _noise_jpeg(src / f"p{i:03d}.jpg", 24 + (i * 37) % 73, seed=i)
        (src / f"p{i:03d}.txt").write_text(f"photo number {i}\n")
    return src


def _estimate(path: Path) -> int:
    """What the test expects ingest to estimate for a local image: 2 KB of json + a header + the file in
    512-byte blocks."""
    return 2048 + 512 + -(-path.stat().st_size // 512) * 512


def _run(cfg: IngestConfig, sd: StageDir, units=None):
    """One ingest run as ``prep`` does it: plan against the stage folder, run units, manifest last."""
    units = list(ingest.plan(cfg, sd)) if units is None else units
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in units]
    sd.write_manifest(records, {"shard_size": cfg.shard_size})
    return units, records


def _shards(sd: StageDir) -> dict[str, str]:
    """name -> sha256 of the file on disk, for every shard of the stage's manifest."""
    out = {}
    for s in sd.read_manifest()["shards"]:
        digest = hashlib.sha256((sd.root / s["path"]).read_bytes()).hexdigest()
        assert digest == s["sha256"]
        out[s["name"]] = digest
    return out


def _ids(unit) -> list[str]:
    """The ids of a unit's entries; none for a unit the plan found committed (it carries no entries)."""
    return sorted(item["id"] for item in unit_items(unit)) if ITEMS_KEY in unit.payload else []


def test_units_follow_the_byte_target(photos, tmp_path):
    cfg = IngestConfig(source=str(photos), shard_bytes=TARGET)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    units, records = _run(cfg, sd)
    expected = {p.name: _estimate(p) for p in photos.glob("*.jpg")}
    total = sum(expected.values())
    assert total > 4 * TARGET  # several units' worth
    assert sorted(i for u in units for i in _ids(u)) == sorted(expected)
    for unit in units:
        assert unit.payload["estimated_bytes"] == sum(expected[i] for i in _ids(unit))
        assert unit.payload["estimated_bytes"] <= TARGET
        assert unit.payload["cut"] == [TARGET, 10_000]
    # hash ranges are halved only while over the target: on average well over half full
    assert total / len(units) >= 0.5 * TARGET
    assert -(-total // TARGET) <= len(units) <= 2 * -(-total // TARGET)
    # one image shard per unit, its bytes close to the estimate (the json's real size differs a little)
    manifest = sd.read_manifest()
    assert len(manifest["shards"]) == len(units) and manifest["counts"]["out"] == 40
    for record, unit in zip(sorted(records, key=lambda r: r.unit_id), sorted(units, key=lambda u: u.unit_id)):
        (shard,) = record.shards
        size = (sd.root / shard.path).stat().st_size
        assert 0.8 * unit.payload["estimated_bytes"] <= size <= unit.payload["estimated_bytes"] + 10240
        assert record.extra["cut"] == [TARGET, 10_000]
    # shard_size stays an upper bound on entries; a file larger than the target makes a unit alone
    few = list(ingest.plan(IngestConfig(source=str(photos), shard_bytes=TARGET, shard_size=3)))
    assert max(u.samples_in for u in few) <= 3 and sum(u.samples_in for u in few) == 40
    tiny = list(ingest.plan(IngestConfig(source=str(photos), shard_bytes=4096)))
    assert len(tiny) == 40 and all(u.samples_in == 1 for u in tiny)
    # the default target (256 MiB) puts these 40 photos in one unit
    assert len(list(ingest.plan(IngestConfig(source=str(photos))))) == 1


def test_a_refresh_keeps_old_shards_and_adds_units_for_new_files_only(photos, tmp_path):
    cfg = IngestConfig(source=str(photos), shard_bytes=TARGET)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    first_units, first = _run(cfg, sd)
    before = _shards(sd)
    new = []
    for i in range(40, 46):
        _noise_jpeg(photos / f"p{i:03d}.jpg", 60 + i, seed=i)
        new.append(f"p{i:03d}.jpg")
    units, second = _run(cfg, sd)
    after = _shards(sd)
    # every old shard: same name, same sha256; every old unit reused
    assert {name: after[name] for name in before} == before
    assert {r.unit_id for r in second if r.reused} == {r.unit_id for r in first}
    fresh = [u for u, r in zip(units, second) if not r.reused]
    assert sorted(i for u in fresh for i in _ids(u)) == sorted(new)
    new_bytes = sum(_estimate(photos / n) for n in new)
    assert len(fresh) == -(-new_bytes // TARGET) and all(u.payload["estimated_bytes"] <= TARGET for u in fresh)
    assert len(after) == len(before) + len(fresh)

    # a removed file re-runs only the unit that held it, which now holds the rest of its files
    gone = _ids(first_units[1])[0]
    (photos / gone).unlink()
    units, third = _run(cfg, sd)
    rerun = [u for u, r in zip(units, third) if not r.reused]
    assert len(rerun) == 1 and _ids(rerun[0]) == [i for i in _ids(first_units[1]) if i != gone]
    final = _shards(sd)
    assert len(final) == len(after) and len(set(final) - set(after)) == 1
    assert sum(u.samples_in for u in units) == 45


def test_a_killed_run_resumes_to_the_bytes_of_a_straight_run(photos, tmp_path):
    cfg = IngestConfig(source=str(photos), shard_bytes=TARGET)
    straight = StageDir(tmp_path / "straight", "ingest").ensure()
    _run(cfg, straight)
    killed = StageDir(tmp_path / "killed", "ingest").ensure()
    units = list(ingest.plan(cfg, killed))
    for unit in units[:2]:  # two units committed, then the process died: no manifest
        killed.run_unit(unit, lambda u, out: ingest.process(cfg, u, out))
    again, records = _run(cfg, killed)
    assert [u.unit_id for u in again] == [u.unit_id for u in units]
    assert sum(r.reused for r in records) == 2
    assert _shards(killed) == _shards(straight)
    samples = [json.loads(s["json"])["source"] for n in _shards(killed)
               for s in read_shard(killed.shard_dir / n)]
    assert sorted(samples) == sorted(p.name for p in photos.glob("*.jpg"))


def test_a_new_byte_target_regroups_as_a_clean_run_does(photos, tmp_path):
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    _run(IngestConfig(source=str(photos), shard_bytes=TARGET), sd)
    half = IngestConfig(source=str(photos), shard_bytes=TARGET // 2)
    units, records = _run(half, sd)
    assert not any(r.reused for r in records)
    assert max(u.payload["estimated_bytes"] for u in units) <= TARGET // 2
    assert [u.unit_id for u in units] == [u.unit_id for u in ingest.plan(half)]


@pytest.mark.parametrize("override, message", [
    ("ingest.shard_bytes=0", "ingest.shard_bytes: the target size of a shard in bytes, must be >= 1, got 0"),
    ("ingest.shard_bytes=-1", "ingest.shard_bytes: the target size of a shard in bytes, must be >= 1, got -1"),
    ("ingest.shard_bytes=lots", "ingest.shard_bytes: expected an integer, got 'lots'"),
    ("ingest.shard_size=0", "ingest.shard_size: at most this many entries per unit, must be >= 1, got 0"),
])
def test_a_bad_key_is_a_config_error_naming_it(override, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_recipe(DEMO_CONFIG, [f"output_dir={tmp_path}", override])
    assert str(err.value) == message


def _reference_listing(root: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """What a folder source lists, by its definition in pathlib terms (the listing before it was made to cost
    one scandir per folder): visible files below ``root`` in path order, sidecars excluded, symlinks
    resolved, symlinked folders not followed, each with the ``.txt`` / ``.json`` beside it."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix.lower() in (".txt", ".json"):
            continue
        sidecars = tuple(str(p) for ext in (".txt", ".json") if (p := path.with_suffix(ext)).is_file())
        out.append((rel.as_posix(), str(path.resolve()), sidecars))
    return out


def test_a_folder_is_listed_with_one_scandir_per_folder_and_no_stat_per_file(tmp_path, monkeypatch):
    import os

    from latentmill.stages.sources import list_source

    src, other = tmp_path / "src", tmp_path / "other"
    for folder in (src / "sub" / "deeper", src / ".hidden", other):
        folder.mkdir(parents=True)
    names = ["a.jpg", "a.txt", "a.json", "b.png", "b.JSON", "c.tar.gz", "c.tar.txt", "d.", "d..txt", "noext",
             "noext.txt", ".dot.jpg", ".hidden/x.jpg", "sub/z.jpg", "sub/z.json", "sub/deeper/y.mp4",
             "sub/deeper/Y.mp4", "sub-a.jpg"] + [f"sub/many{i:03d}.jpg" for i in range(200)]
    for name in names:
        (src / name).write_bytes(b"x")
    (other / "t.jpg").write_bytes(b"t")
    (other / "t.txt").write_text("t")
    (src / "linked-folder").symlink_to(other)
    (src / "linked.jpg").symlink_to(other / "t.jpg")
    (src / "linked.txt").symlink_to(other / "t.txt")
    (src / "broken.jpg").symlink_to(tmp_path / "nowhere")
    expected = _reference_listing(src.resolve())
    assert len(expected) == 210
    calls = {"stat": 0}
    real_stat, real_lstat = os.stat, os.lstat

    def counting(real):
        def stat(*args, **kwargs):
            calls["stat"] += 1
            return real(*args, **kwargs)
        return stat

    monkeypatch.setattr(os, "stat", counting(real_stat))
    monkeypatch.setattr(os, "lstat", counting(real_lstat))
    listed = list_source(str(src)).entries
    monkeypatch.undo()
    assert [(e.id, e.uri, e.sidecars) for e in listed] == expected
    # a few per path component of the root (its checks, its resolution) and of the one symlinked file (its
    # resolution), none per plain file: 20 here; the pathlib listing made about 4 per file (over 800)
    assert calls["stat"] <= 40, calls
    # folders over the scratch's in-memory bound (here "sub", 202 names) are sorted by SQLite: the same listing
    from latentmill.stages import scratch

    monkeypatch.setattr(scratch, "FOLDER_MEMORY", 5)
    assert [(e.id, e.uri, e.sidecars) for e in list_source(str(src)).entries] == expected


def test_an_entry_suffix_is_the_extension_os_path_splitext_finds():
    import os

    from latentmill.stages.sources import Entry

    rng = random.Random(5)
    ids = ["a.JPG", "a.", ".jpg", "..jpg", "a.b.c", "dir.d/name", "x/.hidden", "u?v.jpg", "x.png?y.z", ""]
    ids += ["".join(rng.choice("ab./?.XJ") for _ in range(rng.randrange(9))) for _ in range(5000)]
    for entry_id in ids:
        name = entry_id.split("?", 1)[0].rsplit("/", 1)[-1]
        assert Entry(entry_id, "").suffix == os.path.splitext(name)[1].lower(), entry_id


def test_unchanged_units_are_planned_from_file_metadata(photos, tmp_path, monkeypatch):
    """A refresh plans a unit whose files' (size, mtime, inode) are unchanged from its remembered metadata
    signature: the same unit ids and entry identities, with no file digest looked up. A changed file sends
    only its unit back to the digests; a copy of the folder (other mtimes and inodes) finds the same ids from
    the bytes; a file modified a moment ago gets no signature (racy)."""
    import os
    import shutil

    from latentmill.core.filehashes import FileHashes

    old = 1_700_000_000_000_000_000
    for path in photos.iterdir():
        os.utime(path, ns=(old, old))
    calls = {"sha256": 0}
    real_sha256 = FileHashes.sha256

    def counting_sha256(self, path):
        calls["sha256"] += 1
        return real_sha256(self, path)

    monkeypatch.setattr(FileHashes, "sha256", counting_sha256)
    cfg = IngestConfig(source=str(photos), shard_bytes=TARGET)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    first, _ = _run(cfg, sd)
    assert len(first) >= 3 and calls["sha256"] == 80  # 40 images + 40 sidecars, digests looked up once
    calls["sha256"] = 0
    again = list(ingest.plan(cfg, sd))
    assert calls["sha256"] == 0
    assert sorted((u.unit_id, u.inputs) for u in again) == sorted((u.unit_id, u.inputs) for u in first)

    # one file changes: its unit alone goes back to the digests, and gets a new id
    changed = photos / "p007.jpg"
    _noise_jpeg(changed, 30, seed=999)
    os.utime(changed, ns=(old + 10**9, old + 10**9))
    calls["sha256"] = 0
    third = list(ingest.plan(cfg, sd))
    holder = next(u for u in first if "p007.jpg" in _ids(u))
    assert calls["sha256"] == 2 * len(holder.inputs)
    assert {u.unit_id for u in third} ^ {u.unit_id for u in first} == {
        holder.unit_id, next(u.unit_id for u in third if "p007.jpg" in _ids(u))}

    # a copy (new inodes and mtimes) misses every signature and finds the same ids from the bytes
    copy = tmp_path / "copy"
    shutil.copytree(photos, copy)
    for path in copy.iterdir():
        os.utime(path, ns=(old + 5 * 10**9, old + 5 * 10**9))
    copy_sd = StageDir(tmp_path / "copy-ingest", "ingest").ensure()
    shutil.copytree(sd.root, copy_sd.root, dirs_exist_ok=True)
    calls["sha256"] = 0
    copied = list(ingest.plan(IngestConfig(source=str(copy), shard_bytes=TARGET), copy_sd))
    assert calls["sha256"] == 80
    assert sorted(u.unit_id for u in copied) == sorted(u.unit_id for u in third)

    # a file modified a moment ago: no signature for its unit, which is hashed again next time
    (photos / "p011.txt").write_text("photo number 11, again\n")
    members = sorted(ingest.list_source(str(photos)).entries, key=lambda e: e.id)
    fp, cut = ingest.fingerprint(cfg), [cfg.shard_bytes, cfg.shard_size]
    assert ingest.stat_signature([e for e in members if e.id == "p011.jpg"], fp, cut) is None
    assert ingest.stat_signature([e for e in members if e.id == "p012.jpg"], fp, cut) is not None


def _aged(folder: Path, ns: int = 1_700_000_000_000_000_000) -> None:
    """Every file of ``folder`` modified long ago: outside FileHashes' racy window, so signatures are kept."""
    import os

    for path in folder.iterdir():
        os.utime(path, ns=(ns, ns))


def test_a_refresh_of_unchanged_files_stats_each_once_and_reads_none(photos, tmp_path, monkeypatch):
    """An unchanged refresh: one ``stat`` per file (image and sidecar), as it is listed, and no digest looked
    up or file read; every unit is the committed one."""
    import os
    from collections import Counter

    from latentmill.core.filehashes import FileHashes

    _aged(photos)
    cfg = IngestConfig(source=str(photos), shard_bytes=TARGET)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    first, _ = _run(cfg, sd)
    list(ingest.plan(cfg, sd))  # remembers the signatures (the first run hashed, after it was planned)
    stats, digests = Counter(), {"n": 0}
    real_stat, real_sha256 = os.stat, FileHashes.sha256

    def counting_stat(path, *args, **kwargs):
        stats[str(path)] += 1
        return real_stat(path, *args, **kwargs)

    def counting_sha256(self, path):
        digests["n"] += 1
        return real_sha256(self, path)

    monkeypatch.setattr(os, "stat", counting_stat)
    monkeypatch.setattr(FileHashes, "sha256", counting_sha256)
    again = list(ingest.plan(cfg, sd))
    monkeypatch.undo()
    files = {str(p) for p in photos.iterdir()}
    assert len(files) == 80 and {p: n for p, n in stats.items() if p in files} == {p: 1 for p in files}
    assert digests["n"] == 0
    assert sorted((u.unit_id, u.inputs) for u in again) == sorted((u.unit_id, u.inputs) for u in first)
    assert all(ITEMS_KEY not in u.payload and sd.load_record(u.unit_id) is not None for u in again)


def test_a_touched_or_edited_file_of_a_kept_unit_is_noticed(photos, tmp_path):
    """A file of a kept unit with a new mtime and the same bytes sends its unit to the digests and keeps its
    id (reused, shards unchanged); a caption edited to the same size with a new mtime gives its unit a new
    id, and the new raw shard holds the new caption while every other shard keeps its bytes."""
    import os

    from latentmill.core import filehashes

    _aged(photos)
    cfg = IngestConfig(source=str(photos), shard_bytes=TARGET)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    first, _ = _run(cfg, sd)
    list(ingest.plan(cfg, sd))
    before = _shards(sd)
    reads = []
    real_read = filehashes.sha256_file

    def counting_read(path):
        reads.append(os.path.basename(path))
        return real_read(path)

    filehashes.sha256_file = counting_read
    try:
        old = 1_700_000_000_000_000_000
        os.utime(photos / "p005.jpg", ns=(old + 10**9, old + 10**9))
        touched = list(ingest.plan(cfg, sd))
        assert reads == ["p005.jpg"]  # the unit's other files' digests are remembered
        assert sorted(u.unit_id for u in touched) == sorted(u.unit_id for u in first)

        caption = photos / "p009.txt"
        caption.write_text("photo numbeR 9\n")
        os.utime(caption, ns=(old + 2 * 10**9, old + 2 * 10**9))
        reads.clear()
        edited, _ = _run(cfg, sd)
    finally:
        filehashes.sha256_file = real_read
    assert reads == ["p009.txt"]
    changed = {u.unit_id for u in edited} - {u.unit_id for u in first}
    assert len(changed) == 1 and len(edited) == len(first)
    after = _shards(sd)
    assert len(set(after.values()) - set(before.values())) == 1  # one new raw shard, the rest byte for byte
    record = sd.load_record(changed.pop())
    samples = [s for shard in record.shards for s in read_shard(sd.root / shard.path)]
    captions = {json.loads(s["json"])["source"]: json.loads(s["json"])["sidecar_caption"] for s in samples}
    assert captions["p009.jpg"] == "photo numbeR 9"


def test_the_digest_store_forgets_removed_files_only(photos, tmp_path):
    """A refresh names no file of a kept unit to the digest store, and the store keeps their digests; when it
    holds more files than were listed (files removed), it forgets exactly the removed ones."""
    import sqlite3

    _aged(photos)
    cfg = IngestConfig(source=str(photos), shard_bytes=TARGET)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    _run(cfg, sd)

    def stored() -> set[str]:
        with sqlite3.connect(sd.root / ingest.HASHES_FILE) as db:
            return {Path(row[0]).name for row in db.execute("SELECT path FROM files")}

    everything = {p.name for p in photos.iterdir()}
    for _ in range(2):  # the second refresh keeps every unit by its signature
        list(ingest.plan(cfg, sd))
        assert stored() == everything
    (photos / "p003.jpg").unlink()
    (photos / "p003.txt").unlink()
    list(ingest.plan(cfg, sd))
    assert stored() == everything - {"p003.jpg", "p003.txt"}
