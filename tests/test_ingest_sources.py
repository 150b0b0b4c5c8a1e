"""Ingest from every kind of source (folder, file list, CSV / JSONL / Parquet manifests, webdataset shards,
http), video references, and units that stay put when files are added."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import tarfile
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from latentmill.stages import ingest
from latentmill.stages.ingest import ITEMS_KEY, IngestConfig, unit_items
from latentmill.stages.shardio import StageDir
from latentmill.stages.sources import list_source, source_kind
from latentmill.stages.tarshard import read_shard
from latentmill.stages.video import read_frames

from tests.test_video import write_video


def _ingest(cfg: IngestConfig, root: Path):
    sd = StageDir(root, "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg)]
    sd.write_manifest(records, {"fingerprint": "test"})
    samples = [s for shard in sd.read_manifest()["shards"] for s in read_shard(sd.root / shard["path"])]
    reasons = {q["source"]: q["reason"] for r in records for q in r.quarantined}
    return records, {json.loads(s["json"])["source"]: s for s in samples}, reasons


def _meta(sample) -> dict:
    return json.loads(sample["json"])


@pytest.fixture()
def media(demo_images, tmp_path) -> Path:
    """Three demo images, two videos (one with a .json sidecar) and a broken video."""
    src = tmp_path / "media"
    (src / "clips").mkdir(parents=True)
    for name in ("img_000.png", "img_001.jpg", "img_002.jpg"):
        shutil.copy(demo_images / name, src / name)
        shutil.copy((demo_images / name).with_suffix(".txt"), (src / name).with_suffix(".txt"))
    write_video(src / "clips" / "a.mp4", 24, 12)
    (src / "clips" / "a.txt").write_text("clip a\n")
    write_video(src / "clips" / "b.mp4", 17, 8, width=48, height=64, codec="mpeg4")
    (src / "clips" / "b.json").write_text(json.dumps({"caption": "clip b", "score": 5}))
    (src / "clips" / "broken.mp4").write_bytes(b"not a video" * 20)
    return src


def test_folder_with_videos_stores_references(media, tmp_path):
    records, samples, reasons = _ingest(IngestConfig(source=str(media), shard_size=4), tmp_path / "ingest")
    assert set(samples) == {"img_000.png", "img_001.jpg", "img_002.jpg", "clips/a.mp4", "clips/b.mp4"}
    assert reasons == {"clips/broken.mp4": reasons["clips/broken.mp4"]}
    assert reasons["clips/broken.mp4"].startswith("not a readable video")

    a = samples["clips/a.mp4"]
    assert set(a) == {"__key__", "json"}  # a reference: no media bytes in the raw shard
    meta = _meta(a)
    data = (media / "clips" / "a.mp4").read_bytes()
    assert meta["key"] == a["__key__"] == hashlib.sha256(b"clips/a.mp4").hexdigest()[:16]
    assert meta["kind"] == "video" and meta["source_uri"] == str((media / "clips" / "a.mp4").resolve())
    assert meta["sha256"] == hashlib.sha256(data).hexdigest() and meta["bytes"] == len(data)
    assert (meta["width"], meta["height"], meta["fps"], meta["frames"], meta["codec"]) == (64, 48, 12.0, 24, "h264")
    assert meta["duration"] == 2.0 and meta["format"] == "mp4"
    assert (meta["sidecar_caption"], meta["caption_origin"]) == ("clip a", "sidecar:a.txt")
    b = _meta(samples["clips/b.mp4"])
    assert (b["width"], b["height"], b["fps"], b["frames"], b["codec"]) == (48, 64, 8.0, 17, "mpeg4")
    assert (b["sidecar_caption"], b["caption_origin"]) == ("clip b", "sidecar:b.json")

    img = samples["img_001.jpg"]
    assert img["image"] == (media / "img_001.jpg").read_bytes()  # images keep their bytes
    assert _meta(img)["kind"] == "image" and _meta(img)["source_uri"] == str((media / "img_001.jpg").resolve())
    assert sum(r.samples_in for r in records) == 6


def test_file_list_resolves_relative_paths_and_quarantines_missing_files(media, tmp_path):
    listing = tmp_path / "lists" / "files.txt"
    listing.parent.mkdir()
    listing.write_text(f"# comment\n../media/img_000.png\n\n{media / 'clips' / 'a.mp4'}\n../media/nope.jpg\n"
                       "../media/img_000.png\n")
    assert source_kind(str(listing)) == "list"
    _, samples, reasons = _ingest(IngestConfig(source=str(listing)), tmp_path / "ingest")
    assert set(samples) == {"../media/img_000.png", str(media / "clips" / "a.mp4")}
    assert reasons["../media/nope.jpg"].startswith("file not found")
    assert reasons["../media/img_000.png#dup1"].startswith("listed again in files.txt")
    assert _meta(samples["../media/img_000.png"])["sidecar_caption"]  # sidecar beside the listed file


def _rows(media: Path) -> list[dict]:
    return [{"path": "media/img_001.jpg", "caption": "one from the manifest"},
            {"path": "media/clips/a.mp4", "caption": "a clip from the manifest"},
            {"path": "media/img_002.jpg", "caption": ""}]


def test_csv_manifest_with_caption_column(media, tmp_path):
    manifest = tmp_path / "data.csv"
    with open(manifest, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["path", "caption"])
        writer.writeheader()
        writer.writerows(_rows(media))
    _, samples, reasons = _ingest(IngestConfig(source=str(manifest)), tmp_path / "ingest")
    assert reasons == {}
    one = _meta(samples["media/img_001.jpg"])
    assert (one["sidecar_caption"], one["caption_origin"]) == ("one from the manifest", "data.csv:caption")
    clip = _meta(samples["media/clips/a.mp4"])
    assert clip["kind"] == "video" and clip["sidecar_caption"] == "a clip from the manifest"
    # an empty manifest caption falls back to the sidecar .txt
    assert _meta(samples["media/img_002.jpg"])["caption_origin"] == "sidecar:img_002.txt"


def test_jsonl_manifest_with_file_urls_and_checksums(media, tmp_path):
    good = hashlib.sha256((media / "img_000.png").read_bytes()).hexdigest()
    rows = [{"url": f"file://{media / 'img_000.png'}", "text": "zero", "sha256": good},
            {"url": f"file://{media / 'img_001.jpg'}", "text": "one", "sha256": "0" * 64},
            {"caption": "a row without a path"}]
    manifest = tmp_path / "data.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, samples, reasons = _ingest(IngestConfig(source=str(manifest), caption_column="text"), tmp_path / "ingest")
    assert list(samples) == [f"file://{media / 'img_000.png'}"]
    assert _meta(samples[f"file://{media / 'img_000.png'}"])["sidecar_caption"] == "zero"
    assert reasons[f"file://{media / 'img_001.jpg'}"].startswith("sha256 mismatch")
    assert reasons["data.jsonl#row3"] == "data.jsonl row 3 has no path or url value"


def test_parquet_manifest(media, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_rows(media)), tmp_path / "data.parquet")
    _, samples, reasons = _ingest(IngestConfig(source=str(tmp_path / "data.parquet")), tmp_path / "ingest")
    assert reasons == {} and len(samples) == 3
    assert _meta(samples["media/img_001.jpg"])["sidecar_caption"] == "one from the manifest"


def _write_shard(path: Path, samples: list[dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(data)
                import io

                tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_in_brace_notation(media, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    png, jpg = (media / "img_000.png").read_bytes(), (media / "img_001.jpg").read_bytes()
    video = (media / "clips" / "a.mp4").read_bytes()
    _write_shard(shards / "train-000.tar", [
        {"__key__": "s0", "png": png, "txt": b"caption zero"},
        {"__key__": "s1", "jpg": jpg, "json": json.dumps({"caption": "caption one"}).encode()},
    ])
    _write_shard(shards / "train-001.tar", [
        {"__key__": "v0", "mp4": video, "txt": b"a video in a shard"},
        {"__key__": "odd", "npy": b"\x00" * 8},
    ])
    spec = str(shards / "train-{000..001}.tar")
    assert source_kind(spec) == "webdataset" and len(list_source(spec).shards) == 2
    records, samples, reasons = _ingest(IngestConfig(source=spec), tmp_path / "ingest")
    assert len(records) == 2 and sum(r.samples_in for r in records) == 4
    assert reasons == {"train-001.tar/odd": "no media member with an accepted extension (members: npy)"}
    s0 = samples["train-000.tar/s0.png"]
    assert s0["image"] == png and _meta(s0)["sidecar_caption"] == "caption zero"
    assert _meta(samples["train-000.tar/s1.jpg"])["sidecar_caption"] == "caption one"
    v0 = _meta(samples["train-001.tar/v0.mp4"])
    assert v0["kind"] == "video" and v0["frames"] == 24 and v0["sha256"] == hashlib.sha256(video).hexdigest()
    assert v0["source_uri"] == f"tar://v0.mp4::file://{shards / 'train-001.tar'}"
    # the cache stage opens the reference with read_frames
    assert torch.equal(read_frames(v0["source_uri"], [0, 5]), read_frames(str(media / "clips" / "a.mp4"), [0, 5]))


@pytest.fixture()
def http_root(tmp_path):
    pytest.importorskip("aiohttp")
    root = tmp_path / "www"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_manifest_of_http_urls(media, http_root, tmp_path):
    root, base = http_root
    shutil.copy(media / "img_001.jpg", root / "img_001.jpg")
    shutil.copy(media / "clips" / "a.mp4", root / "a.mp4")
    manifest = root / "list.jsonl"
    manifest.write_text(json.dumps({"url": f"{base}/img_001.jpg", "caption": "over http"}) + "\n"
                        + json.dumps({"url": "a.mp4", "caption": "a video over http"}) + "\n"
                        + json.dumps({"url": f"{base}/missing.jpg"}) + "\n")
    cfg = IngestConfig(source=f"{base}/list.jsonl")
    _, samples, reasons = _ingest(cfg, tmp_path / "ingest")
    assert samples[f"{base}/img_001.jpg"]["image"] == (media / "img_001.jpg").read_bytes()
    clip = _meta(samples["a.mp4"])  # relative to the manifest's URL
    assert clip["source_uri"] == f"{base}/a.mp4" and clip["frames"] == 24 and clip["fps"] == 12.0
    assert clip["sidecar_caption"] == "a video over http"
    assert reasons[f"{base}/missing.jpg"].startswith("cannot read")
    assert read_frames(clip["source_uri"], [3]).shape == (1, 48, 64, 3)
    assert [u.unit_id for u in ingest.plan(cfg)] == [u.unit_id for u in ingest.plan(cfg)]


def test_hash_groups_are_bounded_and_local():
    ids = [f"file_{i:04d}.jpg" for i in range(500)]
    groups = ingest.hash_byte_groups(ids, None, 16)
    assert sorted(i for g in groups for i in g) == list(range(500))
    assert max(len(g) for g in groups) <= 16
    before = {frozenset(ids[i] for i in g) for g in groups}
    more = ids + ["new_a.jpg", "new_b.jpg", "new_c.jpg"]
    after = {frozenset(more[i] for i in g) for g in ingest.hash_byte_groups(more, None, 16)}
    changed, removed = after - before, before - after
    # only groups holding a new id change; a group that overflows splits in two, and then its other half
    # (old ids only) is a new group too
    assert 1 <= len(removed) <= 3 and len(changed) <= 2 * len(removed)
    for group in changed:
        assert group & {"new_a.jpg", "new_b.jpg", "new_c.jpg"} or any(group < old for old in removed)
    for old in removed:
        assert old <= frozenset().union(*changed)


def _ingest_run(cfg, sd):
    units = list(ingest.plan(cfg, sd))
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in units]
    sd.write_manifest(records, {"shard_size": cfg.shard_size})
    return units, records


def test_adding_three_files_reruns_only_their_units(demo_images, tmp_path):
    from PIL import Image

    cfg = IngestConfig(source=str(demo_images), shard_size=8)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    _, first = _ingest_run(cfg, sd)
    assert len(first) >= 4 and not any(r.reused for r in first)
    new = ["added_a.png", "added_b.png", "added_c.png"]
    for i, name in enumerate(new):
        Image.new("RGB", (64, 48), (10 * i, 20, 30)).save(demo_images / name)
    units, second = _ingest_run(cfg, sd)
    # every unit of the first run is kept as it was; the three new files make one new unit of their own
    assert {r.unit_id for r in second if r.reused} == {r.unit_id for r in first}
    rerun = [(u, r) for u, r in zip(units, second) if not r.reused]
    assert [sorted(i["id"] for i in unit_items(u)) for u, _ in rerun] == [new]
    assert sum(r.samples_in for _, r in rerun) == 3 and rerun[0][1].samples_out == 3

    # A changed file re-runs its own unit only; a removed file leaves its unit one smaller.
    changed, removed = sorted(demo_images.glob("img_0*.jpg"))[:2]
    Image.new("RGB", (40, 40), (1, 2, 3)).save(changed, format="JPEG")
    removed.unlink()
    units, third = _ingest_run(cfg, sd)
    rerun = [u for u, r in zip(units, third) if not r.reused]
    held = [{i["id"] for i in unit_items(u)} for u in rerun]
    assert 1 <= len(rerun) <= 2 and any(changed.name in h for h in held)
    # a reused unit carries no entries (it never runs); every other unit names its own
    assert all((ITEMS_KEY in u.payload) == (not r.reused) for u, r in zip(units, third))
    assert not any(removed.name in {i["id"] for i in unit_items(u)} for u in rerun)
    assert len(units) == len(second) and sum(u.samples_in for u in units) == 26 + 3 - 1


def test_a_new_shard_size_regroups_and_a_clean_run_ignores_history(demo_images, tmp_path):
    cfg = IngestConfig(source=str(demo_images), shard_size=8)
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    first, _ = _ingest_run(cfg, sd)
    # without the stage folder (a clean run) the grouping is the hash grouping of a first run
    assert [u.unit_id for u in ingest.plan(cfg)] == [u.unit_id for u in first]
    smaller = IngestConfig(source=str(demo_images), shard_size=4)
    units, _ = _ingest_run(smaller, sd)
    assert max(u.samples_in for u in units) <= 4
    assert [u.unit_id for u in units] == [u.unit_id for u in ingest.plan(smaller)]


def test_layout_keeps_old_units_and_splits_new_entries_evenly():
    ids = [f"f{i:03d}" for i in range(10)]
    previous = [["f000", "f001", "gone"], ["f002", "f003"]]
    groups = ingest.layout(ids, previous, 4)
    assert [[ids[n] for n in g] for g in groups[:2]] == [["f000", "f001"], ["f002", "f003"]]
    rest = groups[2:]
    assert sorted(ids[n] for g in rest for n in g) == ids[4:] and sorted(len(g) for g in rest) == [3, 3]
    assert ingest.layout(ids, [], 4) == ingest.hash_byte_groups(ids, None, 4)


def test_file_hashes_prefetch_answers_a_group_in_a_few_queries(tmp_path):
    """``prefetch`` (the ingest planner's per-unit lookup) gives the digests one-at-a-time lookups give, asks
    SQLite nothing more for the group, and still re-hashes a file changed since it was remembered."""
    import os

    from latentmill.core.filehashes import FileHashes
    from latentmill.core.hashing import sha256_file

    old = 1_700_000_000_000_000_000
    paths = []
    for i in range(1200):  # more than one query's worth (PREFETCH_CHUNK)
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(str(i).encode() * 10)
        os.utime(path, ns=(old, old))
        paths.append(str(path))
    store = tmp_path / "hashes.sqlite"
    first = FileHashes(store)
    expected = [first.sha256(p) for p in paths]
    first.save()
    changed = tmp_path / "f701.bin"
    changed.write_bytes(b"changed")
    os.utime(changed, ns=(old + 5, old + 5))
    expected[701] = sha256_file(changed)
    again = FileHashes(store)
    statements = []
    again._db.set_trace_callback(statements.append)
    again.prefetch(paths)
    queries = len(statements)
    assert [again.sha256(p) for p in paths] == expected
    assert queries == -(-len(paths) // FileHashes.PREFETCH_CHUNK) and len(statements) == queries
    assert again.hashed == 1  # only the changed file was read


def test_file_hashes_are_remembered_while_the_file_is_unchanged(tmp_path):
    import os
    import sqlite3

    from latentmill.core.filehashes import FileHashes
    from latentmill.core.hashing import sha256_file

    path, store = tmp_path / "a.bin", tmp_path / "hashes.sqlite"
    path.write_bytes(b"x" * 1000)
    old = 1_700_000_000_000_000_000
    os.utime(path, ns=(old, old))
    first = FileHashes(store)
    assert first.sha256(path) == sha256_file(path) and first.hashed == 1
    first.save()
    second = FileHashes(store)
    assert second.sha256(path) == sha256_file(path) and second.hashed == 0
    # same size, new bytes and a new mtime: hashed again
    path.write_bytes(b"y" * 1000)
    os.utime(path, ns=(old + 1, old + 1))
    third = FileHashes(store)
    assert third.sha256(path) == sha256_file(path) and third.hashed == 1
    # a file modified a moment ago is hashed but not remembered (its mtime tick may not be over)
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"z")
    third.sha256(fresh)
    third.save()
    rows = dict(sqlite3.connect(store).execute("SELECT path, sha256 FROM files").fetchall())
    assert rows == {str(path): sha256_file(path)}
    assert FileHashes(store).sha256(path) == sha256_file(path)
    # a dataset's store forgets files no longer asked for; a shared one keeps them
    other = tmp_path / "b.bin"
    other.write_bytes(b"w")
    os.utime(other, ns=(old, old))
    shared = FileHashes(store)
    shared.sha256(other)
    shared.save(forget_unused=False)
    assert len(sqlite3.connect(store).execute("SELECT path FROM files").fetchall()) == 2
    own = FileHashes(store)
    own.sha256(other)
    own.save()
    assert sqlite3.connect(store).execute("SELECT path FROM files").fetchall() == [(str(other),)]
    # a damaged store only means hashing again
    store.write_bytes(b"not a database")
    damaged = FileHashes(store)
    assert damaged.sha256(path) == sha256_file(path) and damaged.hashed == 1
    damaged.save()
