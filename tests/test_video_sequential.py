"""Many clips of one video in one forward pass (read_clips, the cache stage): same pixels as clip by clip,
one decoder open per video, rotation kept, a damaged video still quarantined with a reason."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

av = pytest.importorskip("av")

from latentmill.stages import bucket, cache, caption, ingest  # noqa: E402
from latentmill.stages.bucket import BucketConfig  # noqa: E402
from latentmill.stages.cache import CacheConfig  # noqa: E402
from latentmill.stages.caption import CaptionConfig  # noqa: E402
from latentmill.stages.ingest import IngestConfig  # noqa: E402
from latentmill.stages.shardio import StageDir  # noqa: E402
from latentmill.stages.tarshard import read_shard  # noqa: E402
from latentmill.stages.video import (  # noqa: E402
    DECODE_COUNTS,
    ClipPolicy,
    plan_clips,
    read_clips,
    read_frames,
)

from latentmill.models import ModelConfig  # noqa: E402

pytestmark = pytest.mark.slow

FRAMES, FPS, GOP = 300, 24, 24


def write_numbered_video(path: Path, frames: int = FRAMES, width: int = 160, height: int = 96, gop: int = GOP,
                         rotation: int = 0) -> Path:
    """H.264 with B-frames and a keyframe every ``gop`` frames. Frame i shows its index as 9 bits (black or
    white 16×16 squares along the top) over gradients that move with i, so every frame differs."""
    import numpy as np

    yy, xx = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(FPS))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        stream.options = {"threads": "1", "crf": "18", "g": str(gop), "keyint_min": str(gop),
                          "sc_threshold": "0", "bframes": "2"}
        for i in range(frames):
            img = np.zeros((height, width, 3), np.uint8)
            img[..., 0] = (2 * xx + 3 * i) % 256
            img[..., 1] = (3 * yy + 5 * i) % 256
            for bit in range(9):
                img[:16, 16 * bit: 16 * bit + 16] = 255 if (i >> bit) & 1 else 0
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def frame_number(frame_HWC: torch.Tensor) -> int:
    """The index a frame of :func:`write_numbered_video` shows (upright, unrotated)."""
    return sum(1 << bit for bit in range(9) if frame_HWC[8, 16 * bit + 8].float().mean() > 128)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    return write_numbered_video(tmp_path_factory.mktemp("seq") / "numbered.mp4")


def sliding_clips() -> list[list[int]]:
    """17-frame clips at 16 fps from the 24 fps video, every 8 output frames: each overlaps the next."""
    return [list(c.frame_indices) for c in plan_clips(FRAMES, FPS, ClipPolicy((17,), 16.0, "slide", clip_stride=8))]


def per_clip(path: Path, clips: list[list[int]], backend: str, rotation: int = 0) -> list:
    out = []
    for clip in clips:
        try:
            out.append(read_frames(str(path), clip, backend=backend, rotation=rotation))
        except Exception as err:
            out.append(err)
    return out


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, Exception):
            assert type(g) is type(w) and str(g) == str(w), (k, g, w)
        else:
            assert isinstance(g, torch.Tensor) and g.dtype == torch.uint8 and torch.equal(g, w), k


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_one_pass_gives_the_per_clip_pixels_with_one_open(video, backend):
    clips = sliding_clips()
    assert len(clips) == 23 and clips[0][:4] == [0, 2, 3, 5] and clips[1][0] == 12  # overlapping windows
    DECODE_COUNTS.clear()
    got = list(read_clips(str(video), clips, backend=backend, rotation=0))
    assert DECODE_COUNTS[backend] == 1  # one open for 23 clips
    assert DECODE_COUNTS["pyav_seek"] == (1 if backend == "pyav" else 0)  # PyAV: to the first keyframe only
    # frames are dropped once no later clip needs them: about one clip's frames held, not the video's
    assert len({f for c in clips for f in c}) == 193 and DECODE_COUNTS["held_peak"] <= 2 * 17
    want = per_clip(video, clips, backend)
    assert DECODE_COUNTS[backend] == 1 + len(clips)  # clip by clip: an open each
    assert_same(got, want)
    # the frames are the planned ones, in order (a frame's pattern shows its index)
    assert [frame_number(f) for f in got[5]] == clips[5]


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_sparse_out_of_order_and_bad_clips(video, backend):
    """Far-apart clips (a keyframe in every gap: PyAV seeks per gap), a clip listed before an earlier one,
    repeated frames, a clip past the end and an empty one: each as read_frames returns or raises it."""
    clips = [[3, 4, 5], [250, 251, 251, 252], [100, 102, 104], [180, 181], [150], [298, 299, 300], [], [299]]
    DECODE_COUNTS.clear()
    got = list(read_clips(str(video), clips, backend=backend, rotation=0))
    assert DECODE_COUNTS[backend] == 1
    if backend == "pyav":
        # the first keyframe, then 240 (for 250), then back to 96 (for 100: listed after 250), 144, 168, 288
        assert DECODE_COUNTS["pyav_seek"] == 6
    assert_same(got, per_clip(video, clips, backend))
    assert isinstance(got[5], IndexError) and isinstance(got[6], ValueError)
    assert [frame_number(f) for f in got[1]] == [250, 251, 251, 252]


def test_dense_pass_decodes_no_gap_twice_and_seeks_over_a_keyframe_gap(video):
    """The seek rule: decode on through a gap without a keyframe, seek over one that has a keyframe."""
    DECODE_COUNTS.clear()
    list(read_clips(str(video), [[0, 1], [20, 21], [22]], backend="pyav", rotation=0))
    assert DECODE_COUNTS["pyav_seek"] == 1  # 2..19 hold no keyframe (they are at 0, 24, 48...)
    DECODE_COUNTS.clear()
    list(read_clips(str(video), [[0, 1], [50, 51]], backend="pyav", rotation=0))
    assert DECODE_COUNTS["pyav_seek"] == 2  # 48 lies in the gap: decoding from it skips 2..47


def test_a_pass_that_fails_midway_reads_the_rest_clip_by_clip(video, monkeypatch):
    """A decoder error in the middle of the pass (a damaged stream; injected here on the third read) costs
    the pass, not the clips: the rest are read one by one, with read_frames' pixels."""
    import latentmill.stages.video as video_module

    real, calls = video_module._DecordPass.fetch, []

    def failing(self, frames):
        calls.append(frames)
        if len(calls) == 3:
            raise RuntimeError("damaged stream")
        return real(self, frames)

    monkeypatch.setattr(video_module._DecordPass, "fetch", failing)
    clips = sliding_clips()[:6]
    DECODE_COUNTS.clear()
    got = list(read_clips(str(video), clips, backend="decord", rotation=0))
    assert len(calls) == 3 and DECODE_COUNTS["decord"] == 1 + 4  # the pass, then clips 2..5 alone
    assert_same(got, per_clip(video, clips, "decord"))


@pytest.mark.parametrize("rotation", [-90, 180])
def test_a_rotated_video_is_read_upright_in_one_pass(tmp_path, rotation):
    path = write_numbered_video(tmp_path / "phone.mp4", frames=60, rotation=rotation)
    clips = [list(range(s, s + 9)) for s in range(0, 50, 6)]
    DECODE_COUNTS.clear()
    got = list(read_clips(str(path), clips, rotation=rotation))  # auto: PyAV (decord misreads rotated video)
    assert (DECODE_COUNTS["pyav"], DECODE_COUNTS["decord"]) == (1, 0)
    assert_same(got, per_clip(path, clips, "auto", rotation))
    shown = (160, 96) if rotation % 180 else (96, 160)
    assert got[0].shape == (9, *shown, 3)
    upright = torch.rot90(got[2][4], -(round(rotation / 90) % 4), dims=(0, 1))  # back to the coded frame
    assert frame_number(upright) == clips[2][4]
    # rotation=None reads it from the file
    assert torch.equal(next(read_clips(str(path), clips[:1])), got[0])


# ---------------------------------------------------------------------------------------------------------
# The cache stage
# ---------------------------------------------------------------------------------------------------------


def _run(mod_process, sd: StageDir, units) -> list:
    records = [sd.run_unit(u, mod_process) for u in units]
    sd.write_manifest(records, {"fingerprint": "test"})
    return records


def _bucketed(root: Path) -> StageDir:
    """Ingest, caption (sidecars) and bucket the videos of ``root/videos`` into sliding clips."""
    icfg = IngestConfig(source=str(root / "videos"), shard_size=8)
    ing = StageDir(root / "ingest", "ingest").ensure()
    _run(lambda u, o: ingest.process(icfg, u, o), ing, ingest.plan(icfg))
    ccfg = CaptionConfig()
    cap = StageDir(root / "caption", "caption").ensure()
    _run(lambda u, o: caption.process(ccfg, u, o), cap, caption.plan(ccfg, ing))
    bcfg = BucketConfig(resolution=64, aspect_ratios=[1.3333, 1.7778], frame_counts=[5, 9, 17], target_fps=8,
                        clip_strategy="slide", clip_stride=4)
    bkt = StageDir(root / "bucket", "bucket").ensure()
    _run(lambda u, o: bucket.process(bcfg, u, o), bkt, bucket.plan(bcfg, cap))
    return bkt


def _cache_units(root: Path, bkt: StageDir, model: ModelConfig):
    cfg = CacheConfig(dtype="float32", batch_size=4, max_sequence_length=16)
    sd = StageDir(root / "cache", "cache").ensure()
    units = cache.plan(cfg, model, bkt)
    DECODE_COUNTS.clear()
    records = _run(lambda u, o: cache.process(cfg, model, u, o), sd, units)
    return sd, units, records


@pytest.fixture(scope="module")
def two_videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-seq")
    (root / "videos").mkdir()
    for name in ("a", "b"):
        write_numbered_video(root / "videos" / f"{name}.mp4", frames=96)
        (root / "videos" / f"{name}.txt").write_text(f"numbered video {name}")
    return root


def test_the_cache_stage_opens_each_video_once_per_unit(two_videos, tiny_wan):
    """Both videos' clips share one bucket shard, hence one cache unit: two opens for all of them, and the
    latents are those of the clips decoded one by one."""
    from latentmill.stages.cache import load_clip_pixels

    root = two_videos
    bkt = _bucketed(root)
    model = ModelConfig(pretrained=str(tiny_wan))
    sd, units, records = _cache_units(root, bkt, model)
    assert len(units) == 1
    clips = records[0].samples_out
    assert clips == 2 * 4 and not records[0].quarantined  # 96 frames at 24 -> 8 fps (32): 4 windows each
    assert DECODE_COUNTS["decord"] == 2 and DECODE_COUNTS["pyav"] == 0  # clip by clip: 8 opens

    # the cached latents encode the clip-by-clip pixels (read_frames)
    from diffusers import AutoencoderKLWan

    samples = [s for shard in sd.read_manifest()["shards"] for s in read_shard(sd.root / shard["path"])]
    metas = [json.loads(s["json"]) for s in samples]
    assert sorted({m["source"] for m in metas}) == ["a.mp4", "b.mp4"]
    from safetensors.torch import load as load_tensors

    vae = AutoencoderKLWan.from_pretrained(tiny_wan, subfolder="vae")
    pixels = torch.stack([load_clip_pixels(m, {}) for m in metas[:4]])  # the unit's first batch, clip by clip
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean
    mu = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    sigma = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    for j, sample in enumerate(samples[:4]):
        stored = load_tensors(sample["vae.safetensors"])["latents"]
        torch.testing.assert_close(stored, (mean[j] - mu) / sigma, atol=1e-4, rtol=1e-4)


def test_a_truncated_video_is_quarantined_and_the_rest_of_the_unit_cached(tmp_path, tiny_wan):
    root = tmp_path
    (root / "videos").mkdir()
    for name in ("good", "cut"):
        write_numbered_video(root / "videos" / f"{name}.mp4", frames=96)
        (root / "videos" / f"{name}.txt").write_text(f"numbered video {name}")
    bkt = _bucketed(root)
    cut = root / "videos" / "cut.mp4"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # damaged after bucketing, before caching
    sd, units, records = _cache_units(root, bkt, ModelConfig(pretrained=str(tiny_wan)))
    assert len(units) == 1
    (record,) = records
    planned = units[0].samples_in
    assert planned == 2 * 4
    assert record.samples_out + len(record.quarantined) == planned  # counts conserve
    assert record.samples_out == 4
    assert {q["source"] for q in record.quarantined} == {"cut.mp4"}
    assert all(q["reason"].startswith("cannot decode pixels: ") and q["stage"] == "cache"
               for q in record.quarantined)
    metas = [json.loads(s["json"]) for shard in sd.read_manifest()["shards"] for s in read_shard(sd.root / shard["path"])]
    assert {m["source"] for m in metas} == {"good.mp4"}
