"""Edit datasets (``ingest.edit``): a target image, its source image and an instruction are one sample, in each
of the three layouts; a pair stays together through ingest and bucketing, an incomplete one is quarantined
naming it, counts conserve, and an edit recipe over data without pairs stops before any work."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
from latentmill.stages import bucket, ingest
from latentmill.stages.cache import load_pixels
from latentmill.stages.ingest import REFERENCE_MEMBER, IngestConfig
from latentmill.stages.shardio import StageDir
from latentmill.stages.tarshard import read_shard
from PIL import Image

from latentmill.core.config import ConfigError
from latentmill.preflight import check_edit_source


def _image(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path.read_bytes()


def _ingest(cfg: IngestConfig, root: Path):
    sd = StageDir(root, "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg, sd)]
    sd.write_manifest(records, {"shard_size": cfg.shard_size})
    samples = {json.loads(s["json"])["source"]: s for shard in sd.read_manifest()["shards"]
               for s in read_shard(sd.root / shard["path"])}
    reasons = {q["source"]: q["reason"] for r in records for q in r.quarantined}
    return sd, records, samples, reasons


def _check_pair(sample: dict, target: bytes, source: bytes, caption: str) -> None:
    meta = json.loads(sample["json"])
    assert sample["image"] == target and sample[REFERENCE_MEMBER] == source
    assert meta[REFERENCE_MEMBER]["sha256"] == hashlib.sha256(source).hexdigest()
    assert meta["sidecar_caption"] == caption


def test_sidecar_pairs_are_one_sample_and_incomplete_ones_are_quarantined(tmp_path):
    src = tmp_path / "edits"
    a, a_src = _image(src / "a.jpg", (64, 48), (200, 0, 0)), _image(src / "a.src.png", (40, 40), (0, 0, 200))
    b, b_src = _image(src / "sub" / "b.png", (48, 64), (0, 200, 0)), _image(src / "sub" / "b.src.png", (48, 64), (9, 9, 9))
    (src / "a.txt").write_text("make the square red\n")
    (src / "sub" / "b.txt").write_text("turn it green\n")
    _image(src / "c.jpg", (32, 32), (1, 2, 3))  # a target without its source image
    _image(src / "d.src.jpg", (32, 32), (4, 5, 6))  # a source image without its target
    cfg = IngestConfig(source=str(src), edit=True)
    _, records, samples, reasons = _ingest(cfg, tmp_path / "out")
    assert sorted(samples) == ["a.jpg", "sub/b.png"]
    _check_pair(samples["a.jpg"], a, a_src, "make the square red")
    _check_pair(samples["sub/b.png"], b, b_src, "turn it green")
    assert reasons["c.jpg"].startswith("edit pair: no source image for c.jpg (c.src.<ext> beside it")
    assert reasons["d.src.jpg"] == "edit pair: a source image without its target (d.<image extension>)"
    counts = [sum(getattr(r, k) for r in records) for k in ("samples_in", "samples_out")]
    assert counts == [4, 2] and sum(len(r.quarantined) for r in records) == 2  # in = out + quarantined

    # the same folder without ingest.edit: four plain images (the .src ones too), no reference member
    _, _, plain, _ = _ingest(IngestConfig(source=str(src)), tmp_path / "plain")
    assert sorted(plain) == ["a.jpg", "a.src.png", "c.jpg", "d.src.jpg", "sub/b.png", "sub/b.src.png"]
    assert not any(REFERENCE_MEMBER in s for s in plain.values())


def test_paired_folders_and_a_manifest_give_the_same_pairs(tmp_path):
    root = tmp_path / "paired"
    t1, s1 = _image(root / "target" / "x.png", (64, 48), (10, 20, 30)), _image(root / "source" / "x.jpg", (64, 48), (30, 20, 10))
    (root / "target" / "x.txt").write_text("swap the colours\n")
    _image(root / "target" / "y.png", (32, 32), (0, 0, 0))  # no source
    _image(root / "source" / "z.png", (32, 32), (0, 0, 0))  # no target
    _, records, samples, reasons = _ingest(IngestConfig(source=str(root), edit=True), tmp_path / "out")
    assert sorted(samples) == ["x.png"]
    _check_pair(samples["x.png"], t1, s1, "swap the colours")
    assert reasons["y.png"].startswith("edit pair: no source image for y.png")
    assert reasons["source/z.png"] == "edit pair: a source image without its target (target/z.png)"

    manifest = tmp_path / "pairs.csv"
    with open(manifest, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["target", "source", "instruction"])
        writer.writerow([str(root / "target" / "x.png"), "paired/source/x.jpg", "swap the colours"])
        writer.writerow([str(root / "target" / "y.png"), "", "nothing"])
    cfg = IngestConfig(source=str(manifest), edit=True, caption_column="instruction")
    _, _, samples, reasons = _ingest(cfg, tmp_path / "out-manifest")
    (sample,) = samples.values()
    meta = json.loads(sample["json"])
    assert sample["image"] == t1 and sample[REFERENCE_MEMBER] == s1 and meta["sidecar_caption"] == "swap the colours"
    assert any(r.startswith("edit pair: no source image") for r in reasons.values())


def test_a_pair_gets_one_bucket_and_a_changed_source_reruns_its_unit(tmp_path):
    src = tmp_path / "edits"
    _image(src / "a.jpg", (96, 64), (200, 0, 0))
    source = _image(src / "a.src.jpg", (64, 64), (0, 0, 200))
    cfg = IngestConfig(source=str(src), edit=True)
    sd, first, _, _ = _ingest(cfg, tmp_path / "out")
    bcfg = bucket.BucketConfig(resolution=64)
    bsd = StageDir(tmp_path / "out-bucket", "bucket").ensure()
    records = [bsd.run_unit(u, lambda unit, out: bucket.process(bcfg, unit, out)) for u in bucket.plan(bcfg, sd, bsd)]
    (sample,) = [s for r in records for shard in r.shards for s in read_shard(bsd.root / shard.path)]
    meta = json.loads(sample["json"])
    target_px = load_pixels(sample["image"], meta["crop"], meta["bucket"])
    source_px = load_pixels(sample[REFERENCE_MEMBER], meta[REFERENCE_MEMBER]["crop"], meta["bucket"])
    assert target_px.shape == source_px.shape == (3, meta["bucket"][1], meta["bucket"][0])
    assert source_px[2].mean() > 0.5 > source_px[0].mean()  # the blue source, cropped to the target's bucket
    assert sample[REFERENCE_MEMBER] == source

    _image(src / "a.src.jpg", (64, 64), (0, 200, 0))  # a new source image: the pair is new work
    _, second, _, _ = _ingest(cfg, tmp_path / "out")
    assert {r.unit_id for r in second}.isdisjoint({r.unit_id for r in first})


def test_an_edit_recipe_over_data_without_pairs_stops_before_any_work(tmp_path):
    _image(tmp_path / "plain" / "a.jpg", (32, 32), (1, 1, 1))
    with pytest.raises(ConfigError, match=r"ingest.edit: .* holds no edit pairs; put each source image beside"):
        check_edit_source(str(tmp_path / "plain"), tmp_path / "plain", None)
    (tmp_path / "m.csv").write_text("path,caption\na.jpg,x\n")
    with pytest.raises(ConfigError, match="the manifest .* has no 'source' column of source images"):
        check_edit_source(str(tmp_path / "m.csv"), tmp_path / "m.csv", None)
    _image(tmp_path / "plain" / "a.src.jpg", (32, 32), (1, 1, 1))
    check_edit_source(str(tmp_path / "plain"), tmp_path / "plain", None)  # a pair: no error
