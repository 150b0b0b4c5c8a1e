"""Ingest, caption and bucket on tiny inputs: keys, metadata, counts and quarantine reasons."""

from __future__ import annotations

import hashlib
import json

import pytest
from latentmill.stages import bucket, caption, ingest
from latentmill.stages.bucket import BucketConfig, bucket_for, crop_for
from latentmill.stages.caption import CaptionConfig
from latentmill.stages.ingest import IngestConfig
from latentmill.stages.shardio import StageDir, shard_buckets
from latentmill.stages.tarshard import read_shard
from PIL import Image


def _run(stage_mod, cfg, stage_dir, units):
    records = [stage_dir.run_unit(u, lambda unit, out: stage_mod.process(cfg, unit, out)) for u in units]
    stage_dir.write_manifest(records, {"fingerprint": "test"})
    return records


def _ingest(src, root, **kw):
    cfg = IngestConfig(source=str(src), shard_size=8, **kw)
    sd = StageDir(root / "ingest", "ingest").ensure()
    return cfg, sd, _run(ingest, cfg, sd, ingest.plan(cfg))


def _samples(stage_dir):
    manifest = stage_dir.read_manifest()
    return [s for shard in manifest["shards"] for s in read_shard(stage_dir.root / shard["path"])]


def test_ingest_reads_headers_and_quarantines_bad_files(demo_images, tmp_path):
    (demo_images / "notes.md").write_text("not media")
    (demo_images / "empty.png").write_bytes(b"")
    big = Image.new("RGB", (300, 300), (1, 2, 3))
    big.save(demo_images / "big.png")
    _, sd, records = _ingest(demo_images, tmp_path, max_pixels=250 * 250)
    manifest = sd.read_manifest()
    assert manifest["counts"] == {"in": 29, "out": 25, "quarantined": 4}
    reasons = {q["source"]: q["reason"] for r in records for q in r.quarantined}
    assert reasons["broken.jpg"].startswith("not a readable image")
    assert reasons["notes.md"].startswith("unsupported file type .md")
    assert reasons["empty.png"] == "empty file"
    assert "exceeds ingest.max_pixels" in reasons["big.png"]
    # truncated.jpg has a valid header: ingest keeps it, the curate stage (which decodes it) finds out.
    assert "truncated.jpg" not in reasons

    samples = {json.loads(s["json"])["source"]: s for s in _samples(sd)}
    assert len(samples) == 25  # 24 good images + truncated.jpg
    meta = json.loads(samples["img_001.jpg"]["json"])
    data = (demo_images / "img_001.jpg").read_bytes()
    assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert (meta["width"], meta["height"]) == Image.open(demo_images / "img_001.jpg").size == (200, 120)
    assert meta["sidecar_caption"] == (demo_images / "img_001.txt").read_text().strip()
    assert samples["img_001.jpg"]["image"] == data
    png = samples["img_000.png"]
    assert png["image"] == (demo_images / "img_000.png").read_bytes() and json.loads(png["json"])["format"] == "png"


def test_ingest_is_content_addressed(demo_images, tmp_path):
    cfg = IngestConfig(source=str(demo_images), shard_size=8)
    before = [u.unit_id for u in ingest.plan(cfg)]
    assert [u.unit_id for u in ingest.plan(cfg)] == before
    (demo_images / "img_023.txt").write_text("a new caption\n")  # changes only the unit holding img_023
    after = [u.unit_id for u in ingest.plan(cfg)]
    assert sum(a != b for a, b in zip(before, after)) == 1


def test_caption_sidecar_and_missing_policy(demo_images, tmp_path):
    (demo_images / "img_004.txt").unlink()
    _, ing, _ = _ingest(demo_images, tmp_path)
    for policy, expect_out in (("quarantine", 24), ("keep_empty", 25)):
        cfg = CaptionConfig(on_missing=policy)
        sd = StageDir(tmp_path / f"caption-{policy}", "caption").ensure()
        records = _run(caption, cfg, sd, caption.plan(cfg, ing))
        assert sd.read_manifest()["counts"]["out"] == expect_out
        texts = {json.loads(s["json"])["source"]: s["txt"].decode() for s in _samples(sd)}
        assert texts["img_001.jpg"] == (demo_images / "img_001.txt").read_text().strip()
        if policy == "quarantine":
            (q,) = [q for r in records for q in r.quarantined]
            assert q["source"] == "img_004.jpg" and "no caption" in q["reason"]
        else:
            assert texts["img_004.jpg"] == ""


@pytest.mark.parametrize("size, expected", [((200, 120), (144, 80)), ((120, 200), (80, 144)),
                                             ((160, 160), (112, 112)), ((256, 144), (144, 80))])
def test_bucket_for_known_sizes(size, expected):
    cfg = BucketConfig(resolution=112, aspect_ratios=[0.5625, 1.0, 1.7778])
    assert bucket_for(*size, cfg) == (*expected, 1)


def test_buckets_are_multiples_of_step_within_budget():
    cfg = BucketConfig(resolution=512)
    for w in range(64, 2048, 97):
        for h in range(64, 2048, 89):
            bw, bh, frames = bucket_for(w, h, cfg)
            assert bw % 16 == 0 and bh % 16 == 0 and frames == 1
            assert 0.85 * 512 * 512 <= bw * bh <= 1.15 * 512 * 512
            crop = crop_for(w, h, (bw, bh, 1))
            assert crop["resize_width"] >= bw and crop["resize_height"] >= bh
            assert crop["left"] + bw <= crop["resize_width"] and crop["top"] + bh <= crop["resize_height"]


def test_bucket_stage_shards_hold_several_buckets_with_their_counts(demo_images, tmp_path):
    # (layout 2: a unit writes one shard of every bucket it meets; it was one shard per bucket before)
    _, ing, _ = _ingest(demo_images, tmp_path)
    ccfg = CaptionConfig()
    cap = StageDir(tmp_path / "caption", "caption").ensure()
    _run(caption, ccfg, cap, caption.plan(ccfg, ing))
    cfg = BucketConfig(resolution=128, aspect_ratios=[0.5625, 0.75, 1.0, 1.3333, 1.7778])
    sd = StageDir(tmp_path / "bucket", "bucket").ensure()
    _run(bucket, cfg, sd, bucket.plan(cfg, cap))
    manifest = sd.read_manifest()
    assert manifest["counts"] == {"in": 25, "out": 25, "quarantined": 0}
    for shard in manifest["shards"]:
        metas = [json.loads(s["json"]) for s in read_shard(sd.root / shard["path"])]
        counts: dict[str, int] = {}
        for m in metas:
            counts["x".join(map(str, m["bucket"]))] = counts.get("x".join(map(str, m["bucket"])), 0) + 1
        assert shard_buckets(shard) == counts and len(metas) == shard["samples"]
        assert shard["bucket"] is None if len(counts) > 1 else shard["bucket"] == metas[0]["bucket"]
        for m in metas:
            assert tuple(m["bucket"]) == bucket_for(m["width"], m["height"], cfg)
    assert any(shard["bucket"] is None for shard in manifest["shards"])  # default 256 MiB: one unit, 5 buckets
    assert sum(bucket.histogram(manifest).values()) == 25
    assert set(bucket.histogram(manifest)) == {"128x128x1", "112x144x1", "144x112x1", "96x176x1", "176x96x1"}
