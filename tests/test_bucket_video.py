"""Videos through ingest -> caption -> bucket: clips as samples, buckets W×H×F, honest counts; the video demo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("av")

from latentmill.stages import bucket, caption, ingest  # noqa: E402
from latentmill.stages.bucket import BucketConfig  # noqa: E402
from latentmill.stages.caption import CaptionConfig  # noqa: E402
from latentmill.stages.ingest import IngestConfig  # noqa: E402
from latentmill.stages.shardio import StageDir, stage_report  # noqa: E402
from latentmill.stages.tarshard import read_shard  # noqa: E402
from latentmill.stages.video import probe_video  # noqa: E402

from latentmill.recipe import load_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO_VIDEOS = REPO / "data" / "demo" / "videos"
DEMO_VIDEO_CONFIG = REPO / "configs" / "demo-video.yaml"


def _run(mod, cfg, sd, units):
    records = [sd.run_unit(u, lambda unit, out: mod.process(cfg, unit, out)) for u in units]
    sd.write_manifest(records, {"fingerprint": "test"})
    return records


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    """The demo videos ingested and captioned (sidecars), shared by the tests of this module."""
    root = tmp_path_factory.mktemp("video-prep")
    src = root / "videos"
    shutil.copytree(DEMO_VIDEOS, src)
    icfg = IngestConfig(source=str(src), shard_size=4)
    ing = StageDir(root / "ingest", "ingest").ensure()
    ingest_report = stage_report("ingest", _run(ingest, icfg, ing, ingest.plan(icfg)), 0.0)
    ccfg = CaptionConfig()
    cap = StageDir(root / "caption", "caption").ensure()
    _run(caption, ccfg, cap, caption.plan(ccfg, ing))
    return root, src, ingest_report, cap


def _bucket(captioned, name, **kw):
    root, _, _, cap = captioned
    cfg = BucketConfig(resolution=64, aspect_ratios=[0.75, 1.0, 1.3333], frame_counts=[5, 9, 17],
                       target_fps=8, **kw)
    sd = StageDir(root / name, "bucket").ensure()
    records = _run(bucket, cfg, sd, bucket.plan(cfg, cap))
    metas = [json.loads(s["json"]) for shard in sd.read_manifest()["shards"]
             for s in read_shard(sd.root / shard["path"])]
    return sd, records, {m["key"]: m for m in metas}


def _clips(metas, source):
    return sorted((m for m in metas.values() if m["source"] == source), key=lambda m: m["clip_index"])


def test_ingest_quarantines_the_broken_demo_video(captioned):
    _, _, report, cap = captioned
    assert (report["in"], report["out"], report["quarantined"]) == (8, 7, 1)
    assert cap.read_manifest()["counts"] == {"in": 7, "out": 7, "quarantined": 0}


def test_uniform_clips_with_scene_split(captioned):
    pytest.importorskip("scenedetect")
    sd, records, metas = _bucket(captioned, "uniform", clip_strategy="uniform", clips_per_video=2,
                                 scene_split=True)
    report = stage_report("bucket", records, 0.0)
    # 7 videos in; the short one is quarantined; 6 videos give 14 clips (the cut video 2 per scene)
    assert (report["in"], report["out"], report["quarantined"]) == (7, 14, 1)
    assert (report["videos"], report["clips"], report["expanded"]) == (7, 14, 8)
    assert report["in"] + report["expanded"] == report["out"] + report["quarantined"]
    (q,) = [q for r in records for q in r.quarantined]
    assert q["source"] == "short_64x48_24fps.mp4"
    assert q["reason"] == ("video too short: 12 frames at 24 fps give 4 frames at 8 fps; "
                           "the smallest bucket needs 5 frames (bucket.frame_counts; clips are 4k+1 frames, "
                           "bucket.frame_step)")

    ball = _clips(metas, "ball_64x48_24fps.mp4")  # 40 frames at 24 fps -> every 3rd frame, 9-frame clips
    assert [m["clip"] for m in ball] == [
        {"start_frame": s, "num_frames": 9, "fps": 8.0, "frame_indices": list(range(s, s + 25, 3))} for s in (0, 15)]
    assert [m["key"] for m in ball] == [f"{ball[0]['video_key']}-c0", f"{ball[0]['video_key']}-c1"]
    assert all(m["bucket"] == [80, 48, 9] and m["crop"]["policy"] == "center" for m in ball)

    tall = _clips(metas, "tall_48x64_12fps.mp4")  # 12 -> 8 fps: 1.5 source frames per output frame
    assert [m["clip"]["frame_indices"] for m in tall] == [[0, 2, 3, 5, 6, 8, 9, 11, 12],
                                                          [11, 13, 14, 16, 17, 19, 20, 22, 23]]
    assert tall[0]["bucket"] == [48, 80, 9]

    cut = _clips(metas, "cut_64x48_12fps.mp4")  # hard cut at frame 18: two scenes of 18 frames
    assert [m["clip"]["start_frame"] for m in cut] == [0, 5, 18, 23]
    assert all(m["scene_cuts"] == [18] for m in cut)
    for m in cut:
        indices = m["clip"]["frame_indices"]
        assert indices[-1] < 18 or indices[0] >= 18

    pause = _clips(metas, "pause_64x48_8fps.mp4")  # 34 frames at 8 fps: its still half, then its moving half
    assert [(m["clip"]["start_frame"], m["bucket"]) for m in pause] == [(0, [80, 48, 17]), (17, [80, 48, 17])]

    wide = _clips(metas, "wide_80x48_8fps.mp4")  # 8 fps source: kept, 17-frame clips
    assert [m["clip"]["start_frame"] for m in wide] == [0, 15] and wide[0]["bucket"] == [80, 48, 17]
    assert wide[0]["sidecar_caption"] == "a white square crossing a black background, wide video"

    for m in metas.values():  # everything the cache stage needs to decode a clip
        assert m["kind"] == "video" and Path(m["source_uri"]).is_file() and m["caption"]
        assert m["clip"]["num_frames"] == len(m["clip"]["frame_indices"]) == m["bucket"][2]
        assert max(m["clip"]["frame_indices"]) < m["frames"]
    assert bucket.histogram(sd.read_manifest()) == {"48x80x9": 2, "64x64x17": 2, "80x48x17": 4, "80x48x9": 6}


def test_head_and_slide_clip_counts(captioned):
    _, records, metas = _bucket(captioned, "head")
    assert stage_report("bucket", records, 0.0)["clips"] == 6  # one per usable video
    assert _clips(metas, "cut_64x48_12fps.mp4")[0]["clip"]["num_frames"] == 17  # no split: spans the cut
    _, records, metas = _bucket(captioned, "slide", clip_strategy="slide", clip_stride=4)
    report = stage_report("bucket", records, 0.0)
    starts = {src: [m["clip"]["start_frame"] for m in _clips(metas, src)] for src in
              ("ball_64x48_24fps.mp4", "wide_80x48_8fps.mp4", "square_64x64_8fps.mp4")}
    # ball: 9-frame windows span 25 frames, stride 4 output frames = 12 source frames
    assert starts == {"ball_64x48_24fps.mp4": [0, 12], "wide_80x48_8fps.mp4": [0, 4, 8, 12],
                      "square_64x64_8fps.mp4": [0]}
    assert report["in"] + report["expanded"] == report["out"] + report["quarantined"]


def test_random_crops_are_per_clip_and_reproducible(captioned):
    _, _, first = _bucket(captioned, "random-a", clip_strategy="uniform", clips_per_video=2, crop="random", seed=3)
    _, _, again = _bucket(captioned, "random-b", clip_strategy="uniform", clips_per_video=2, crop="random", seed=3)
    assert {k: m["crop"] for k, m in first.items()} == {k: m["crop"] for k, m in again.items()}
    assert all(m["crop"]["policy"] == "random" and m["crop"]["seed"] == 3 for m in first.values())


def test_reencoded_clips_hold_exactly_their_frames(captioned):
    import io

    import decord
    from latentmill.stages.video import read_clip

    sd, records, metas = _bucket(captioned, "reencode", clip_strategy="head", reencode=True,
                                 reencode_keyframe_interval=1)
    assert stage_report("bucket", records, 0.0)["out"] == 6
    shards = sd.read_manifest()["shards"]
    samples = {s["__key__"]: s for shard in shards for s in read_shard(sd.root / shard["path"])}
    (tall,) = _clips(metas, "tall_48x64_12fps.mp4")
    sample = samples[tall["key"]]
    assert tall["clip"]["reencoded"] == {"member": "mp4", "codec": "h264", "keyframe_interval": 1, "crf": 17}
    info = probe_video(sample["mp4"])
    assert (info["frames"], info["fps"], info["width"], info["height"]) == (9, 8.0, 48, 64)
    reader = decord.VideoReader(io.BytesIO(sample["mp4"]))
    assert list(reader.get_key_indices()) == list(range(9))  # all-intra: any frame is one seek away
    from_member = read_clip(tall, sample)
    from_source = read_clip({**tall, "clip": {**tall["clip"], "reencoded": None}})  # the reference path
    assert from_member.shape == from_source.shape == (9, 64, 48, 3)
    assert (from_member.float() - from_source.float()).abs().mean() < 3  # crf 17: close to the source


def test_bucket_units_are_reused_on_a_rerun(captioned):
    pytest.importorskip("scenedetect")
    _bucket(captioned, "rerun", clip_strategy="uniform", clips_per_video=2, scene_split=True)
    _, records, _ = _bucket(captioned, "rerun", clip_strategy="uniform", clips_per_video=2, scene_split=True)
    assert all(r.reused for r in records)
    report = stage_report("bucket", records, 0.0)
    assert (report["reused"], report["processed"], report["clips"], report["expanded"]) == (7, 0, 14, 8)


def test_demo_videos_match_their_recipe(tmp_path):
    """The committed files have the sizes, lengths and rates make_demo_videos.py asks for; regenerating
    gives files with the same header facts (the bytes depend on the FFmpeg build, so they are not compared)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_demo_videos", REPO / "data" / "make_demo_videos.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.generate(tmp_path)
    for name, (width, height, frames, fps, *_rest) in make.VIDEOS.items():
        expected = {"width": width, "height": height, "frames": frames, "fps": float(fps),
                    "duration": round(frames / fps, 6), "codec": "h264"}
        assert probe_video(str(DEMO_VIDEOS / f"{name}.mp4")) == expected
        assert probe_video(str(tmp_path / f"{name}.mp4")) == expected
    total = sum(p.stat().st_size for p in DEMO_VIDEOS.iterdir())
    assert total < 300_000


def test_demo_video_recipe_loads():
    pytest.importorskip("scenedetect")  # the demo splits scenes; without the package the recipe is refused
    recipe = load_recipe(DEMO_VIDEO_CONFIG)
    assert recipe.ingest.source == str(REPO / "data" / "demo" / "videos")  # the shipped data, from any folder
    assert recipe.bucket.frame_count_list() == [5, 9, 17] and recipe.bucket.target_fps == 8.0
    assert recipe.bucket.scene_split and recipe.model.pretrained == str(REPO / "data" / "models" / "tiny-wan")
    # per-clip motion: pause_64x48_8fps's still clip 0.02, every other demo clip >= 1.45 (tests/test_e2e_video.py)
    assert recipe.curate.min_motion == 0.7 and "motion" in recipe.curate.active_scorers()
