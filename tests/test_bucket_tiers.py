"""Bucket choices: multi-tier pixel budgets, no_upscale, random crops, config errors."""

from __future__ import annotations

import json

import pytest
from latentmill.stages import bucket
from latentmill.stages.bucket import BucketConfig, TooSmall, bucket_for, crop_for
from latentmill.stages.shardio import StageDir, UnitOutput, WorkUnit, stage_report
from latentmill.stages.tarshard import read_shard

from latentmill.core.config import ConfigError, from_dict
from latentmill.core.hashing import json_bytes


@pytest.mark.parametrize("size, nearest, no_upscale", [
    ((100, 100), (128, 128), (64, 64)),  # 10000 px: nearest budget 128², largest that fits 64²
    ((300, 300), (256, 256), (256, 256)),
    ((1000, 1000), (256, 256), (256, 256)),  # no tier above 256: the largest
    ((200, 120), (176, 96), (176, 96)),  # 16:9 ratio at 128²: 176x96 fits inside 200x120
])
def test_multi_tier_choices(size, nearest, no_upscale):
    ratios = [0.5625, 1.0, 1.7778]
    assert bucket_for(*size, BucketConfig(resolutions=[64, 128, 256], aspect_ratios=ratios)) == (*nearest, 1)
    cfg = BucketConfig(resolutions=[64, 128, 256], aspect_ratios=ratios, no_upscale=True)
    assert bucket_for(*size, cfg) == (*no_upscale, 1)


def test_no_upscale_checks_both_sides_not_only_the_pixel_count():
    # 300x100 has 30000 px, more than the 160² budget, but its 2:1 bucket there (224x112) is taller than it
    ratios = [1.0, 2.0]
    assert bucket_for(300, 100, BucketConfig(resolutions=[128, 160], aspect_ratios=ratios)) == (224, 112, 1)
    cfg = BucketConfig(resolutions=[128, 160], aspect_ratios=ratios, no_upscale=True)
    assert bucket_for(300, 100, cfg) == (176, 96, 1)
    crop = crop_for(300, 100, (176, 96, 1))
    assert crop["resize_width"] <= 300 and crop["resize_height"] <= 100  # a downscale, never enlarged
    with pytest.raises(TooSmall, match="smaller than the smallest image bucket 64x64"):
        bucket_for(40, 40, BucketConfig(resolutions=[64], no_upscale=True))


def test_default_tiers_for_images_and_video():
    cfg = BucketConfig()
    assert cfg.tiers("image") == [256, 512, 1024] and cfg.tiers("video") == [640, 960]
    assert bucket_for(1920, 1080, cfg, frames=81) == (1280, 720, 81)  # 720p
    assert bucket_for(854, 480, cfg, frames=81) == (848, 480, 81)  # 480p
    assert bucket_for(300, 300, cfg) == (256, 256, 1)
    # one resolution (the legacy key) serves both; video_resolutions splits them
    assert BucketConfig(resolution=128).tiers("video") == [128]
    assert BucketConfig(resolution=128, video_resolutions=[64]).tiers("video") == [64]


def test_random_crop_is_deterministic_per_seed_and_within_bounds():
    bucket_wh = (128, 128, 1)
    crops = {seed: [crop_for(300, 200, bucket_wh, "random", seed, f"k{i}") for i in range(20)] for seed in (0, 1)}
    assert crops[0] == [crop_for(300, 200, bucket_wh, "random", 0, f"k{i}") for i in range(20)]
    assert crops[0] != crops[1]
    assert len({c["left"] for c in crops[0]}) > 5  # offsets actually vary across samples
    for c in crops[0] + crops[1]:
        assert 0 <= c["left"] <= c["resize_width"] - 128 and 0 <= c["top"] <= c["resize_height"] - 128
    assert crop_for(300, 200, bucket_wh)["left"] == (192 - 128) // 2  # center


def _image_shard(tmp_path, sizes):
    sd = StageDir(tmp_path / "up", "caption").ensure()

    def write(unit, out: UnitOutput):
        for i, (w, h) in enumerate(sizes):
            meta = {"key": f"k{i}", "source": f"img{i}.png", "kind": "image", "width": w, "height": h}
            out.add({"__key__": f"k{i}", "png": b"x", "json": json_bytes(meta)})

    sd.write_manifest([sd.run_unit(WorkUnit("u" * 64, [], {}, len(sizes)), write)], {"fingerprint": "f"})
    return sd


def test_bucket_stage_records_random_crops_and_quarantines_too_small(tmp_path):
    upstream = _image_shard(tmp_path, [(300, 200), (200, 300), (40, 40)])
    cfg = BucketConfig(resolutions=[64, 128], aspect_ratios=[0.6667, 1.0, 1.5], no_upscale=True,
                       crop="random", seed=7)
    sd = StageDir(tmp_path / "bucket", "bucket").ensure()
    records = [sd.run_unit(u, lambda unit, out: bucket.process(cfg, unit, out)) for u in bucket.plan(cfg, upstream)]
    report = stage_report("bucket", records, 0.0)
    assert (report["in"], report["out"], report["quarantined"]) == (3, 2, 1)
    assert (report["videos"], report["clips"], report["expanded"]) == (0, 0, 0)
    (q,) = records[0].quarantined
    assert q["source"] == "img2.png" and "bucket.no_upscale" in q["reason"]
    metas = {m["key"]: m for s in records[0].shards for m in
             (json.loads(x["json"]) for x in read_shard(sd.root / s.path))}
    assert metas["k0"]["bucket"] == [160, 112, 1] and metas["k1"]["bucket"] == [112, 160, 1]
    crop = metas["k0"]["crop"]
    assert crop == {"policy": "random", "seed": 7, **crop_for(300, 200, (160, 112, 1), "random", 7, "k0")}


@pytest.mark.parametrize("override, message", [
    ({"crop": "diagonal"}, "bucket.crop: 'diagonal' is not one of 'center', 'random'"),
    ({"clip_strategy": "every"}, "bucket.clip_strategy: 'every' is not one of 'head', 'uniform', 'slide'"),
    ({"frame_counts": [5, 8]}, r"bucket.frame_counts: 8 is not frame_step·k\+1 .*allowed: 1, 5, 9"),
    ({"resolutions": [8]}, "bucket.resolutions: needs at least one pixel budget"),
    ({"clips_per_video": 0}, "bucket.clips_per_video: must be >= 1"),
    ({"target_fps": 0}, "bucket.target_fps: must be > 0 or null"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(BucketConfig, override, prefix="bucket")


def test_fingerprint_follows_what_decides_the_output():
    base = bucket.fingerprint(BucketConfig(resolution=64))
    assert bucket.fingerprint(BucketConfig(resolution=64)) == base
    assert bucket.fingerprint(BucketConfig(resolution=64, seed=3)) == base  # seed only matters for random
    for changed in (dict(crop="random"), dict(no_upscale=True), dict(target_fps=8.0), dict(resolution=128),
                    dict(frame_counts=[5, 9])):
        assert bucket.fingerprint(BucketConfig(**{"resolution": 64, **changed})) != base


def test_scene_split_without_scenedetect_is_refused_up_front(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scenedetect" else real(name, *a))
    with pytest.raises(ConfigError, match="bucket.scene_split: true needs the scenedetect package"):
        from_dict(BucketConfig, {"scene_split": True}, prefix="bucket")
