"""Odd videos through ingest -> bucket -> the cache stage's pixels: odd and tiny sizes, sizes off the VAE's
multiple, extreme aspect ratios, one frame, too long, too large, truncated and empty files. Each is bucketed and
cropped, or quarantined with a reason; nothing crashes and the counts conserve."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from latentmill.stages import bucket, ingest  # noqa: E402
from latentmill.stages.bucket import BucketConfig  # noqa: E402
from latentmill.stages.cache import load_clip_pixels  # noqa: E402
from latentmill.stages.ingest import IngestConfig  # noqa: E402
from latentmill.stages.shardio import StageDir, stage_report  # noqa: E402
from latentmill.stages.tarshard import read_shard  # noqa: E402


def write(path: Path, frames: int, fps: float, width: int, height: int, noise: bool = False) -> Path:
    """Frame i is flat grey 7·i (or seeded noise); 4:4:4 so that odd sizes encode (4:2:0 needs even ones)."""
    fmt = "matroska" if path.suffix == ".mkv" else "mp4"
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        stream.options = {"threads": "1", "crf": "1", "g": "4"}
        for i in range(frames):
            img = (np.random.default_rng(i).integers(0, 256, (height, width, 3), dtype=np.uint8) if noise
                   else np.full((height, width, 3), 7 * i % 256, np.uint8))
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _run(mod, cfg, sd, units):
    records = [sd.run_unit(u, lambda unit, out: mod.process(cfg, unit, out)) for u in units]
    sd.write_manifest(records, {"fingerprint": "test"})
    return records


def _reasons(records):
    return {q["source"]: q["reason"] for r in records for q in r.quarantined}


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd-videos")
    src = root / "videos"
    src.mkdir()
    write(src / "odd_35x21.mp4", 9, 8, 35, 21)
    write(src / "offgrid_50x30.mp4", 9, 8, 50, 30)  # neither side a multiple of 16
    write(src / "tiny_2x2.mp4", 9, 8, 2, 2)
    write(src / "thin_128x4.mp4", 9, 8, 128, 4)  # 32:1, far beyond the widest bucket
    write(src / "one_frame.mp4", 1, 8, 48, 32)
    write(src / "long_1fps.mp4", 9, 1, 32, 32)  # 9 s, over the limit below
    write(src / "large_96x64.mp4", 5, 8, 96, 64)  # 6,144 pixels a frame, over the limit below
    for name in ("cut.mkv", "cut.mp4"):  # written whole, then cut in half: a download that stopped
        whole = write(root / name, 40, 8, 64, 48, noise=True).read_bytes()
        (src / f"truncated_{name}").write_bytes(whole[: len(whole) // 2])
    (src / "empty.mp4").write_bytes(b"")
    cfg = IngestConfig(source=str(src), max_video_seconds=5, max_pixels=6000)
    sd = StageDir(root / "ingest", "ingest").ensure()
    return root, sd, _run(ingest, cfg, sd, ingest.plan(cfg))


def test_ingest_quarantines_long_large_unreadable_and_empty_videos_with_reasons(ingested):
    _, _, records = ingested
    report = stage_report("ingest", records, 0.0)
    assert (report["in"], report["out"], report["quarantined"]) == (10, 6, 4)
    assert _reasons(records) == {
        "long_1fps.mp4": "video is 9 s long, over ingest.max_video_seconds=5; raise it, or cut the video into parts",
        "large_96x64.mp4": "96x64 exceeds ingest.max_pixels=6000",
        "truncated_cut.mp4": _reasons(records)["truncated_cut.mp4"],
        "empty.mp4": "empty file",
    }
    # an MP4 cut in half lost its index (written last): not a readable video
    assert _reasons(records)["truncated_cut.mp4"].startswith("not a readable video: ")


def _bucket(ingested, name, frame_counts):
    root, ing, _ = ingested
    cfg = BucketConfig(resolution=64, target_fps=8, frame_counts=frame_counts)
    sd = StageDir(root / name, "bucket").ensure()
    records = _run(bucket, cfg, sd, bucket.plan(cfg, ing))
    samples = [s for shard in sd.read_manifest()["shards"] for s in read_shard(sd.root / shard["path"])]
    return cfg, records, {json.loads(s["json"])["source"]: s for s in samples}


def test_odd_sizes_are_bucketed_and_cropped_and_one_frame_is_too_short(ingested):
    cfg, records, samples = _bucket(ingested, "bucket", [5, 9])
    report = stage_report("bucket", records, 0.0)
    assert (report["in"], report["out"], report["quarantined"], report["expanded"]) == (6, 5, 1, 0)
    assert _reasons(records) == {"one_frame.mp4": (
        "video too short: 1 frames at 8 fps give 1 frames at 8 fps; the smallest bucket needs 5 frames "
        "(bucket.frame_counts; clips are 4k+1 frames, bucket.frame_step)")}
    metas = {source: json.loads(s["json"]) for source, s in samples.items()}
    assert {source: tuple(m["bucket"]) for source, m in metas.items()} == {
        "odd_35x21.mp4": (80, 48, 9), "offgrid_50x30.mp4": (80, 48, 9), "tiny_2x2.mp4": (64, 64, 9),
        "thin_128x4.mp4": (96, 48, 9), "truncated_cut.mkv": (80, 48, 9)}
    # the truncated MKV is probed at the frames it still holds, and its clip lies within them
    assert 0 < metas["truncated_cut.mkv"]["frames"] < 40
    assert metas["truncated_cut.mkv"]["clip"]["frame_indices"][-1] < metas["truncated_cut.mkv"]["frames"]
    for source, sample in samples.items():
        width, height, frames = metas[source]["bucket"]
        assert width % cfg.step == 0 and height % cfg.step == 0
        pixels_CFHW = load_clip_pixels(metas[source], sample)  # what the cache stage encodes
        assert pixels_CFHW.shape == (3, frames, height, width), source
    # the odd-sized clip's frames are its grey levels 7·i, resized whole (a flat frame stays flat)
    odd = load_clip_pixels(metas["odd_35x21.mp4"], samples["odd_35x21.mp4"])
    grey = (odd.mean(dim=(0, 2, 3)) + 1) * 127.5
    assert grey.tolist() == pytest.approx([7.0 * i for i in range(9)], abs=2)
    # the 32:1 video fills the 2:1 bucket's height and is cropped at the centre of its width
    assert metas["thin_128x4.mp4"]["crop"] == {"policy": "center", "resize_width": 1536, "resize_height": 48,
                                               "left": 720, "top": 0}


def test_a_one_frame_video_is_a_one_frame_clip_when_the_recipe_admits_one(ingested):
    _, records, samples = _bucket(ingested, "bucket-one", [1, 5, 9])
    assert _reasons(records) == {}
    meta = json.loads(samples["one_frame.mp4"]["json"])
    assert meta["bucket"] == [80, 48, 1] and meta["clip"]["frame_indices"] == [0]
    assert load_clip_pixels(meta, samples["one_frame.mp4"]).shape == (3, 1, 48, 80)


def test_a_rotated_phone_video_is_bucketed_portrait_and_its_pixels_come_out_upright(tmp_path):
    src = tmp_path / "videos"
    src.mkdir()
    path = src / "phone.mp4"
    with av.open(str(path), "w") as container:  # coded 64x48 landscape: red left half, blue right half
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv444p"
        stream.set_display_rotation(-90)  # the display matrix a phone writes for portrait footage
        img = np.zeros((48, 64, 3), np.uint8)
        img[:, :32, 0], img[:, 32:, 2] = 255, 255
        for _ in range(5):
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    icfg = IngestConfig(source=str(src))
    ing = StageDir(tmp_path / "ingest", "ingest").ensure()
    _run(ingest, icfg, ing, ingest.plan(icfg))
    bcfg = BucketConfig(resolution=64, target_fps=8, frame_counts=[5])
    sd = StageDir(tmp_path / "bucket", "bucket").ensure()
    _run(bucket, bcfg, sd, bucket.plan(bcfg, ing))
    (sample,) = [s for shard in sd.read_manifest()["shards"] for s in read_shard(sd.root / shard["path"])]
    meta = json.loads(sample["json"])
    assert (meta["width"], meta["height"], meta["rotation"], meta["bucket"]) == (48, 64, -90, [48, 80, 5])
    pixels_CFHW = load_clip_pixels(meta, sample)
    assert pixels_CFHW.shape == (3, 5, 80, 48)
    # shown a quarter turn clockwise: the red half on top, the blue half below
    top, bottom = pixels_CFHW[:, 0, :24].mean(dim=(1, 2)), pixels_CFHW[:, 0, 56:].mean(dim=(1, 2))
    assert top[0] > 0.9 and top[2] < -0.9 and bottom[2] > 0.9 and bottom[0] < -0.9


def test_exact_fps_gives_every_clip_one_rate_and_quarantines_slower_sources(tmp_path):
    from latentmill.stages.audio import clip_span

    src = tmp_path / "videos"
    src.mkdir()
    write(src / "fast_30fps.mp4", 40, 30, 32, 32)
    write(src / "ntsc_23.976fps.mp4", 40, Fraction(24000, 1001), 32, 32)
    write(src / "slow_12fps.mp4", 40, 12, 32, 32)
    icfg = IngestConfig(source=str(src))
    ing = StageDir(tmp_path / "ingest", "ingest").ensure()
    _run(ingest, icfg, ing, ingest.plan(icfg))

    def clips(exact):
        cfg = BucketConfig(resolution=32, step=32, frame_step=8, frame_counts=[9, 17], target_fps=24, exact_fps=exact)
        sd = StageDir(tmp_path / f"bucket-{exact}", "bucket").ensure()
        records = _run(bucket, cfg, sd, bucket.plan(cfg, ing))
        metas = [json.loads(s["json"]) for shard in sd.read_manifest()["shards"]
                 for s in read_shard(sd.root / shard["path"])]
        return records, {m["source"]: m for m in metas}

    # by default a slower source keeps its own rate: one bucket, 32x32x17, of clips at three rates
    _, metas = clips(False)
    assert {s: (m["clip"]["fps"], m["bucket"]) for s, m in metas.items()} == {
        "fast_30fps.mp4": (24.0, [32, 32, 17]), "ntsc_23.976fps.mp4": (pytest.approx(23.976024), [32, 32, 17]),
        "slow_12fps.mp4": (12.0, [32, 32, 17])}
    assert len({round(clip_span(m)[1], 6) for m in metas.values()}) == 3  # sound windows of 3 lengths
    # exact: the 12 fps source is quarantined, the NTSC one is taken frame for frame at 24 fps
    records, metas = clips(True)
    assert _reasons(records) == {"slow_12fps.mp4": (
        "video at 12 fps is slower than bucket.target_fps 24, and bucket.exact_fps gives every clip that one rate "
        "(clips are never upsampled); lower bucket.target_fps to 12 or leave the video out")}
    assert {s: m["clip"]["fps"] for s, m in metas.items()} == {"fast_30fps.mp4": 24.0, "ntsc_23.976fps.mp4": 24.0}
    assert metas["ntsc_23.976fps.mp4"]["clip"]["frame_indices"] == list(range(17))
    assert metas["fast_30fps.mp4"]["clip"]["frame_indices"][:6] == [0, 1, 3, 4, 5, 6]  # 30 -> 24: every 1.25
    assert {clip_span(m)[1] for m in metas.values()} == {17 / 24}  # one sound length: the batch stacks


@pytest.mark.parametrize("rate, layout, tone", [(8000, "mono", 440.0), (96000, "5.1", 1000.0)])
def test_sound_at_unusual_rates_and_layouts_is_cut_to_the_audio_vaes_rate(tmp_path, rate, layout, tone):
    from latentmill.stages.audio import read_audio

    path = tmp_path / "v.mp4"
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        audio = container.add_stream("aac", rate=rate)
        audio.layout = layout
        for _ in range(8):  # one second of video
            for packet in video.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")):
                container.mux(packet)
        wave = (0.1 * np.sin(2 * np.pi * tone * np.arange(rate) / rate)).astype(np.float32)
        channels = audio.layout.nb_channels
        for start in range(0, rate, 1024):
            chunk = av.AudioFrame.from_ndarray(np.repeat(wave[None, start:start + 1024], channels, axis=0),
                                               format="fltp", layout=layout)
            chunk.sample_rate, chunk.pts = rate, start
            for packet in audio.encode(chunk):
                container.mux(packet)
        for stream in (audio, video):
            for packet in stream.encode():
                container.mux(packet)
    (window,), track = read_audio(str(path), [(0.25, 0.5)], 16000)
    assert track and window.shape == (2, 8000)  # LTX-2's audio VAE: 16 kHz stereo, whatever the source
    spectrum = np.abs(np.fft.rfft(window[0].numpy()))
    assert np.argmax(spectrum) * 16000 / 8000 == pytest.approx(tone, abs=4)  # the tone, resampled, not aliased
    assert float(window.pow(2).mean().sqrt()) > 0.02


def test_the_limits_keep_their_fingerprint_through_a_recipe_round_trip():
    """A default written as an int where the key is a float (14400 for 14400.0) hashed differently after a
    recipe's dict round trip, so an unchanged prep looked changed (tests/test_unchanged.py)."""
    from dataclasses import asdict

    from latentmill.core.config import from_dict

    for stage, cls in ((ingest, IngestConfig), (bucket, BucketConfig)):
        cfg = cls(source="videos") if cls is IngestConfig else cls(exact_fps=True)
        again = from_dict(cls, json.loads(json.dumps(asdict(cfg))))
        assert json.dumps(stage.fingerprint(again)) == json.dumps(stage.fingerprint(cfg))
