"""Per-clip video scores: the curate stage plans a video's clips as the bucket stage will, scores each on K
of its frames (every clip of a video in one decode), and the bucket stage quarantines the clips that fail a
threshold while the others are cached; a threshold change recomputes no clip score and encodes no kept clip."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from latentmill.stages import cache, caption, curate, curate_clips, curate_models, ingest  # noqa: E402
from latentmill.stages.bucket import BucketConfig  # noqa: E402
from latentmill.stages.caption import CaptionConfig  # noqa: E402
from latentmill.stages.ingest import IngestConfig  # noqa: E402
from latentmill.stages.shardio import StageDir, sample_json, stage_report  # noqa: E402
from latentmill.stages.tarshard import read_shard  # noqa: E402
from latentmill.stages.video import DECODE_COUNTS, plan_clips, read_frames  # noqa: E402
from PIL import Image  # noqa: E402

from latentmill.recipe import load_recipe  # noqa: E402
from tests.helpers import prep_in_process  # noqa: E402
from tests.test_curate import ScorerCalls  # noqa: E402
from tests.test_curate_models import tiny_clip  # noqa: E402,F401  (a fixture: a tiny CLIP folder and head)

REPO = Path(__file__).resolve().parents[1]
FPS, FRAMES, STILL = 24, 96, 48  # half.mp4: frames 0..47 show one picture, from 48 on it moves
# 24 -> 8 fps, 5-frame clips (13 source frames), a window every 5 output frames: 6 clips, the first 3 still
BUCKET = {"resolution": 64, "aspect_ratios": [1.3333], "frame_counts": [5], "target_fps": 8.0,
          "clip_strategy": "slide", "clip_stride": 5}
MIN_MOTION = 2.0  # between the still clips (< 0.1 grey levels, codec noise) and the moving ones (> 10)
K = 4


def write_video(path: Path, still: int = STILL, frames: int = FRAMES, width: int = 64, height: int = 48) -> Path:
    """H.264 at 24 fps: frames before ``still`` show one gradient picture; from ``still`` on it slides
    (4 grey levels a frame in red, 3 in green): every frame differs."""
    yy, xx = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(FPS))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"threads": "1", "crf": "10", "g": "12"}
        for i in range(frames):
            t = max(0, i - still + 1)
            img = np.zeros((height, width, 3), np.uint8)
            img[..., 0] = (4 * xx + 6 * t) % 256
            img[..., 1] = (5 * yy + 3 * t) % 256
            img[..., 2] = 90
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def video_folder(root: Path, images: bool = False) -> Path:
    """``half.mp4`` (still, then moving) and ``still.mp4`` (still throughout), each with a caption; with
    ``images`` also two PNG pictures."""
    root.mkdir(parents=True)
    write_video(root / "half.mp4")
    write_video(root / "still.mp4", still=FRAMES)
    for name in ("half", "still"):
        (root / f"{name}.txt").write_text(f"a video called {name}\n")
    if images:
        for i in range(2):
            Image.fromarray(np.full((40, 48, 3), 60 * i + 40, np.uint8)).save(root / f"picture_{i}.png")
            (root / f"picture_{i}.txt").write_text(f"picture {i}\n")
    return root


def _run(sd: StageDir, units, process) -> list:
    records = [sd.run_unit(u, process) for u in units]
    sd.write_manifest(records, {"fingerprint": "test"})
    return records


def captioned(root: Path, images: bool = False) -> StageDir:
    """The folder's samples ingested and captioned (sidecars); the caption stage folder."""
    icfg = IngestConfig(source=str(video_folder(root / "videos", images)), shard_size=4)
    ing = StageDir(root / "prep" / "ingest", "ingest").ensure()
    _run(ing, ingest.plan(icfg), lambda u, o: ingest.process(icfg, u, o))
    ccfg = CaptionConfig()
    cap = StageDir(root / "prep" / "caption", "caption").ensure()
    _run(cap, caption.plan(ccfg, ing), lambda u, o: caption.process(ccfg, u, o))
    return cap


def run_curate(cap: StageDir, cfg: curate.CurateConfig, spec) -> tuple[StageDir, list]:
    sd = StageDir(cap.root.parent / "curate", "curate").ensure()
    records = _run(sd, curate.plan(cfg, cap, clips=spec), lambda u, o: curate.process(cfg, u, o, clips=spec))
    stage_report("curate", records, 0.0)  # in = out + quarantined
    return sd, records


@pytest.fixture()
def cap(tmp_path) -> StageDir:
    return captioned(tmp_path)


def spec_of(**overrides) -> curate_clips.ClipSpec:
    return curate_clips.clip_spec(BucketConfig(**{**BUCKET, **overrides}))


def _rows(stage_dir: StageDir, records) -> dict[str, dict]:
    return {k: row for r in records for k, row in (stage_dir.unit_detail(r).get("scores") or {}).items()}


def test_clip_scores_equal_a_direct_computation_on_each_clips_k_frames(cap):
    cfg = curate.CurateConfig(scorers=["sharpness", "exposure", "motion"], frames=K)
    spec = spec_of()
    sd, records = run_curate(cap, cfg, spec)
    path = Path(cap.root.parent.parent / "videos" / "half.mp4")
    clips = plan_clips(FRAMES, FPS, spec.policy)
    assert [c.frame_indices[0] for c in clips] == [0, 15, 30, 45, 60, 75]
    # K = 4 of each clip's 5 frames (its source frames 3 apart): the centres of 4 equal segments
    assert [curate_clips.clip_score_indices(c, K) for c in clips[:2]] == [[0, 3, 9, 12], [15, 18, 24, 27]]
    rows = _rows(sd, records)
    (video_key,) = {row["video"] for row in rows.values() if row["source"] == "half.mp4"}
    for j, clip in enumerate(clips):
        row = rows[f"{video_key}-c{j}"]
        assert row["kind"] == "clip"
        # the clip's 4 frames decoded directly, one read per clip, and scored by the definitions
        greys = [np.asarray(Image.fromarray(f).convert("L"), np.float64)
                 for f in read_frames(str(path), curate_clips.clip_score_indices(clip, K)).numpy()]
        laplacians = [g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4 * g[1:-1, 1:-1] for g in greys]
        want = {"sharpness": np.mean([lap.var() for lap in laplacians]),
                "exposure": np.mean([np.mean((g == 0) | (g == 255)) for g in greys]),
                "motion": np.mean([np.abs(b - a).mean() for a, b in zip(greys, greys[1:])])}
        assert row["values"] == pytest.approx(want, abs=1e-6)
        assert (row["values"]["motion"] < 0.5) == (j < 3)  # the still half and the moving half
    assert min(rows[f"{video_key}-c{j}"]["values"]["motion"] for j in (3, 4, 5)) > 10
    # the video's json carries every clip's verdict for the bucket stage, and no whole-video score
    metas = {m["source"]: m for shard in sd.read_manifest()["shards"]
             for m in map(sample_json, read_shard(sd.root / shard["path"]))}
    half = metas["half.mp4"]
    assert "scores" not in half
    assert [(e["start_frame"], e["num_frames"], e.get("failed")) for e in half["clip_scores"]] == \
        [(c.start_frame, 5, None) for c in clips]
    assert [e["scores"] for e in half["clip_scores"]] == [rows[f"{video_key}-c{j}"]["values"] for j in range(6)]


def test_model_scores_per_clip_equal_a_direct_call_on_the_clips_frames(cap, tiny_clip):  # noqa: F811
    """aesthetic and clip_score per clip, batched over a video's clips: the values of scoring each clip's K
    frames on their own, in two image forwards per video (6 clips x 4 frames at batch_size 16)."""
    folder, head = tiny_clip
    cfg = curate.CurateConfig(scorers=["aesthetic", "clip_score"], aesthetic_model=str(folder),
                              aesthetic_head=str(head), frames=K)
    cfg.validate()
    spec = spec_of()
    before = dict(curate_models.FORWARDS)
    sd, records = run_curate(cap, cfg, spec)
    assert curate_models.FORWARDS["image"] - before["image"] == 2 * 2
    assert curate_models.FORWARDS["text"] - before["text"] == 2 * 1
    rows = _rows(sd, records)
    path = Path(cap.root.parent.parent / "videos" / "half.mp4")
    (video_key,) = {row["video"] for row in rows.values() if row["source"] == "half.mp4"}
    for j, clip in enumerate(plan_clips(FRAMES, FPS, spec.policy)):
        frames = [Image.fromarray(f) for f in read_frames(str(path), curate_clips.clip_score_indices(clip, K)).numpy()]
        (want,) = curate_models.model_scores(cfg, [frames], ["a video called half"], [["aesthetic", "clip_score"]])
        got = rows[f"{video_key}-c{j}"]["values"]
        assert set(got) == {"aesthetic", "clip_score"}
        assert got == pytest.approx(want, abs=2e-5)


def test_every_clip_of_a_video_is_decoded_in_one_pass(cap, monkeypatch):
    """One decoder open per video for all its clips (counted by the real reader), one read_clips call per
    video (wrapped, not replaced); a threshold change opens nothing and scores nothing."""
    calls = ScorerCalls(monkeypatch)
    reads = []
    real = curate_clips.read_clips
    monkeypatch.setattr(curate_clips, "read_clips",
                        lambda uri, lists, **kw: (reads.append([list(x) for x in lists]), real(uri, lists, **kw))[1])
    DECODE_COUNTS.clear()
    run_curate(cap, curate.CurateConfig(scorers=["sharpness", "exposure", "motion"], frames=K), spec_of())
    assert DECODE_COUNTS["decord"] + DECODE_COUNTS["pyav"] == 2  # two videos, twelve clips
    assert len(reads) == 2 and all(len(lists) == 6 and all(len(x) == K for x in lists) for lists in reads)
    assert calls.take() == 2 * 6 * K * 2  # two model-free scorers on K frames of 6 clips of 2 videos
    DECODE_COUNTS.clear()
    _, records = run_curate(cap, curate.CurateConfig(scorers=["sharpness", "exposure"], frames=K,
                                                     min_motion=MIN_MOTION), spec_of())
    assert calls.take() == 0 and not reads[2:] and DECODE_COUNTS["decord"] + DECODE_COUNTS["pyav"] == 0
    report = curate.report(records)
    assert (report["clips_scored"], report["clip_scores_reused"], report["clips_below_threshold"]) == (0, 12, 9)


def test_only_units_holding_videos_carry_the_clip_plan(tmp_path):
    """An image unit's id is the same with or without per-clip scoring and whatever the clip plan; a
    video unit's id changes with the plan."""
    cap = captioned(tmp_path, images=True)
    cfg = curate.CurateConfig(shard_bytes=1)  # a unit per upstream shard: images and videos apart

    def ids(spec):
        return {("video" if u.payload.get("clips") else "image"): u.unit_id for u in curate.plan(cfg, cap, clips=spec)}

    plain = {u.unit_id for u in curate.plan(cfg, cap)}
    one, other = ids(spec_of()), ids(spec_of(clip_stride=4))
    assert set(one) == {"image", "video"}
    assert one["image"] == other["image"] and one["image"] in plain
    assert one["video"] != other["video"] and one["video"] not in plain


def test_scene_cuts_are_detected_once_in_curate_and_reused_by_bucket(tmp_path, monkeypatch):
    pytest.importorskip("scenedetect")
    from latentmill.stages import bucket

    cap = captioned(tmp_path)
    spec = spec_of(scene_split=True)
    detected = []
    real = curate_clips.detect_cuts
    monkeypatch.setattr(curate_clips, "detect_cuts", lambda *a: (detected.append(a), real(*a))[1])
    sd, _ = run_curate(cap, curate.CurateConfig(frames=K), spec)
    assert len(detected) == 2
    metas = {m["source"]: m for shard in sd.read_manifest()["shards"]
             for m in map(sample_json, read_shard(sd.root / shard["path"]))}
    # the slide from frame 48 on is no cut; the curate stage records what it found at which threshold
    assert all(m["scene_threshold"] == 27.0 and isinstance(m["scene_cuts"], list) for m in metas.values())
    monkeypatch.setattr(bucket, "detect_cuts", lambda *a: pytest.fail("the bucket stage detected cuts again"))
    bcfg = BucketConfig(**BUCKET, scene_split=True)
    bkt = StageDir(tmp_path / "prep" / "bucket", "bucket").ensure()
    records = _run(bkt, bucket.plan(bcfg, sd), lambda u, o: bucket.process(bcfg, u, o))
    assert stage_report("bucket", records, 0.0)["clips"] == 12


@pytest.mark.slow
def test_still_clips_are_quarantined_by_bucket_moving_ones_cached_and_thresholds_are_free(tmp_path, tiny_wan,
                                                                                          monkeypatch):
    videos = video_folder(tmp_path / "videos")
    out = tmp_path / "out"
    calls = ScorerCalls(monkeypatch)
    motions = []
    real_motion = curate_models.motion
    monkeypatch.setattr(curate_models, "motion", lambda greys: (motions.append(1), real_motion(greys))[1])

    def prep(min_motion: float) -> dict:
        recipe = load_recipe(REPO / "configs" / "demo-video.yaml", [
            f"output_dir={out}", f"model.pretrained={tiny_wan}", f"ingest.source={videos}",
            *(f"bucket.{k}={json.dumps(v)}" for k, v in BUCKET.items()), "bucket.scene_split=false",
            f"curate.min_motion={min_motion}"])
        result = prep_in_process(recipe)
        for stage, (_, _, records) in result.items():
            stage_report(stage, records, 0.0)  # raises when in (+ expanded) != out + quarantined
        return result

    first = prep(MIN_MOTION)
    assert calls.take() == 12 * K * 2 and len(motions) == 12  # 12 clips: K frames each, 2 model-free scorers
    # curate: still.mp4's every clip is still, so it goes whole; half.mp4 goes on with its verdicts
    curate_dir, manifest, records = first["curate"]
    assert manifest["counts"] == {"in": 2, "out": 1, "quarantined": 1}
    (whole,) = [q for r in records for q in r.quarantined]
    assert whole["source"] == "still.mp4" and whole["stage"] == "curate"
    assert whole["reason"] == f"every clip beyond a threshold: motion beyond curate.min_motion={MIN_MOTION:g}"
    assert len(whole["clip_scores"]) == 6 and all(e["scores"]["motion"] < 0.5 for e in whole["clip_scores"])
    # bucket: half.mp4's 6 clips, the 3 still ones quarantined with the reason and their scores
    bucket_dir, bucket_manifest, bucket_records = first["bucket"]
    report = stage_report("bucket", bucket_records, 0.0)
    assert (report["in"], report["clips"], report["out"], report["quarantined"], report["expanded"]) == (1, 6, 3, 3, 5)
    dropped = sorted((q for r in bucket_records for q in r.quarantined), key=lambda q: q["key"])
    video_key = dropped[0]["video_key"]
    assert [q["key"] for q in dropped] == [f"{video_key}-c{j}" for j in range(3)]
    assert all(q["reason"] == f"motion beyond curate.min_motion={MIN_MOTION:g}" and q["stage"] == "bucket"
               and q["scores"]["motion"] < 0.5 for q in dropped)
    # cache: the 3 moving clips, each with its own scores
    cache_dir, cache_manifest, cache_records = first["cache"]
    cached = {m["key"]: m for shard in cache_manifest["shards"]
              for m in map(sample_json, read_shard(cache_dir.root / shard["path"]))}
    assert sorted(cached) == [f"{video_key}-c{j}" for j in (3, 4, 5)]
    assert all(m["scores"]["motion"] > 10 and "clip_scores" not in m for m in cached.values())
    assert cache.component_report(cache_records)["components"]["vae"] == {"processed": 3, "reused": 0}
    # the scores table: a row per clip
    import pyarrow.parquet as pq

    table = pq.read_table(out / "prep" / "scores.parquet").to_pylist()
    assert len(table) == 12 and {r["kind"] for r in table} == {"clip"}
    assert sorted(r["key"] for r in table if r["status"] == "kept") == sorted(cached)
    assert {r["threshold"] for r in table if r["status"] == "quarantined"} == {"curate.min_motion"}
    # inspect's contact sheet draws the bucket's quarantined clips from their video, at the clip's first frame
    pytest.importorskip("matplotlib")
    from latentmill import plots

    (tmp_path / "plots").mkdir()
    sheet = plots.contact_sheet("bucket", dropped[0]["reason"], dropped, out / "prep", tmp_path / "plots")
    assert sheet.data["tiles"] == 3 and sheet.data["undecodable"] == 0

    # A threshold that keeps the same clips: no score computed, no video decoded, no clip encoded.
    DECODE_COUNTS.clear()
    second = prep(MIN_MOTION * 2)
    assert calls.take() == 0 and not motions[12:] and DECODE_COUNTS["decord"] + DECODE_COUNTS["pyav"] == 0
    assert cache.component_report(second["cache"][2])["components"]["vae"]["processed"] == 0
    assert second["cache"][1]["counts"]["out"] == 3
    # Loosened: every clip comes in (still.mp4 too); only the 9 new clips are encoded, nothing scored.
    third = prep(0.0)
    assert calls.take() == 0 and not motions[12:]
    assert third["cache"][1]["counts"]["out"] == 12
    assert cache.component_report(third["cache"][2])["components"]["vae"]["processed"] == 9
    # Tightened again: nothing scored, nothing encoded.
    again = prep(MIN_MOTION)
    assert calls.take() == 0 and again["cache"][1]["counts"]["out"] == 3
    assert cache.component_report(again["cache"][2])["components"]["vae"]["processed"] == 0


def test_near_duplicate_embeddings_stay_per_video_from_the_same_decode(cap):
    """With near duplicates on, a video's embedding is the one it always had (its K whole-video frames'
    thumbnail), decoded in the pass that scores its clips: still one open per video."""
    from latentmill.stages import neardup

    cfg = curate.CurateConfig(frames=K, dedup_threshold=0.92)
    DECODE_COUNTS.clear()
    sd, records = run_curate(cap, cfg, spec_of())
    assert DECODE_COUNTS["decord"] + DECODE_COUNTS["pyav"] == 2
    emb = records[0].extra["embeddings"]
    vectors = np.load(sd.root / emb["file"])
    samples = {s["__key__"]: s for shard in cap.read_manifest()["shards"] for s in read_shard(cap.root / shard["path"])}
    assert sorted(emb["keys"]) == sorted(samples)
    for key, vector in zip(emb["keys"], vectors):
        frames = curate.decode_frames(samples[key], sample_json(samples[key]), cfg)  # whole video, on its own
        np.testing.assert_allclose(vector, neardup.thumbnail_embedding(frames), atol=1e-6)
    # the keep rule's aesthetic of a video scored per clip: the mean of its clips'
    rows = {"v-c0": {"video": "v", "values": {"aesthetic": 4.0}}, "v-c1": {"video": "v", "values": {"aesthetic": 6.0}},
            "img": {"values": {"aesthetic": 3.0}}}
    assert neardup.video_aesthetics(rows) == {"v": 5.0}


def test_a_new_clip_plan_scores_only_the_clip_windows_it_did_not_have(cap, monkeypatch):
    """Clip windows are score keys: a wider slide stride keeps every other window (reused, no decode), a
    stride that moves the windows scores them anew."""
    calls = ScorerCalls(monkeypatch)
    cfg = curate.CurateConfig(frames=K)
    run_curate(cap, cfg, spec_of())  # windows start at 0, 15, 30, 45, 60, 75
    calls.take()
    DECODE_COUNTS.clear()
    _, records = run_curate(cap, cfg, spec_of(clip_stride=10))  # 0, 30, 60: scored before
    report = curate.report(records)
    assert (report["clips_scored"], report["clip_scores_reused"]) == (0, 6)
    assert calls.take() == 0 and DECODE_COUNTS["decord"] + DECODE_COUNTS["pyav"] == 0
    _, records = run_curate(cap, cfg, spec_of(clip_stride=4))  # 0, 12, 24, 36, 48, 60, 72: 0 and 60 known
    report = curate.report(records)
    assert (report["clips_scored"], report["clip_scores_reused"]) == (2 * 5, 2 * 2)
    assert calls.take() == 2 * 5 * K * 2
