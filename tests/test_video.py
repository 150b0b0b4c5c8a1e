"""Video probing, frame reading, clip planning and scene cuts on synthetic videos written with PyAV."""

from __future__ import annotations

import json
import tarfile
from fractions import Fraction
from pathlib import Path

import pytest
import torch

av = pytest.importorskip("av")

from latentmill.stages.video import (  # noqa: E402
    ClipPolicy,
    admissible_frame_counts,
    detect_cuts,
    plan_clips,
    probe_video,
    read_frames,
    resample,
    too_short_reason,
)

WAN = tuple(admissible_frame_counts(4, 81))  # 5, 9, ..., 81


def write_video(path: Path, frames: int, fps: float, width: int = 64, height: int = 48,
                codec: str = "libx264", cut: int | None = None, rotation: int = 0,
                halves: bool = False) -> Path:
    """Frame i is flat grey 6·i (a readable index) — or, with ``cut``, two visually distinct scenes; with
    ``halves`` a red left half and a blue right half. ``rotation``: the display matrix (degrees CCW)."""
    import numpy as np

    fmt = {"webm": "webm", "mkv": "matroska"}.get(path.suffix[1:], "mp4")
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        if codec == "libx264":
            stream.options = {"threads": "1", "crf": "1", "bframes": "2"}
        elif codec == "mpeg4":
            stream.options = {"qscale": "1"}
        for i in range(frames):
            img = np.full((height, width, 3), 6 * i % 256, np.uint8)
            if cut is not None:
                img[:] = (40, 80, 220) if i < cut else (230, 230, 40)
                img[: height // 3, (2 * i) % width : (2 * i) % width + 6] = 0
            if halves:
                img[:, : width // 2], img[:, width // 2:] = (255, 0, 0), (0, 0, 255)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.mark.parametrize("frames, fps, width, height, codec, name", [
    (24, 12, 64, 48, "libx264", "h264"),
    (37, 24, 48, 64, "mpeg4", "mpeg4"),
    (30, 30000 / 1001, 80, 48, "libx264", "h264"),
])
def test_probe_reads_header_facts(tmp_path, frames, fps, width, height, codec, name):
    path = write_video(tmp_path / "v.mp4", frames, fps, width, height, codec)
    info = probe_video(str(path))
    assert info == {"width": width, "height": height, "fps": pytest.approx(fps, abs=1e-5), "frames": frames,
                    "duration": pytest.approx(frames / fps, abs=1e-5), "codec": name}
    assert probe_video(path.read_bytes()) == info  # bytes (remote sources) give the same answer


def test_probe_refuses_broken_and_empty_videos(tmp_path):
    (tmp_path / "garbage.mp4").write_bytes(b"not a video" * 20)
    with pytest.raises(ValueError, match="not a readable video"):
        probe_video(str(tmp_path / "garbage.mp4"))
    # A valid MP4 header without a single frame.
    with av.open(str(tmp_path / "empty.mp4"), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height = 32, 32
        container.start_encoding()
    with pytest.raises(ValueError, match="no video stream|no frames"):
        probe_video(str(tmp_path / "empty.mp4"))


def test_read_frames_returns_requested_frames_in_order(tmp_path):
    path = write_video(tmp_path / "v.mp4", 30, 12)
    frames_FHWC = read_frames(str(path), [7, 0, 7, 29])
    assert frames_FHWC.shape == (4, 48, 64, 3) and frames_FHWC.dtype == torch.uint8
    grey = frames_FHWC.float().mean(dim=(1, 2, 3))
    assert torch.allclose(grey, torch.tensor([42.0, 0.0, 42.0, 174.0]), atol=3)
    # decord and the PyAV fallback decode the same pixels; bytes and tar members read like paths
    assert torch.equal(read_frames(str(path), [7, 0, 7, 29], backend="pyav"), frames_FHWC)
    assert torch.equal(read_frames(path.read_bytes(), [7, 0, 7, 29]), frames_FHWC)
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        tar.add(path, arcname="k/v.mp4")
    assert torch.equal(read_frames(f"tar://k/v.mp4::file://{tmp_path / 's.tar'}", [7, 0, 7, 29]), frames_FHWC)
    for backend in ("auto", "pyav"):
        with pytest.raises(IndexError):
            read_frames(str(path), [30], backend=backend)


def test_read_frames_falls_back_to_pyav_when_decord_cannot_open(tmp_path, monkeypatch):
    import latentmill.stages.video as video

    path = write_video(tmp_path / "v.mp4", 10, 8)

    def broken(*_):
        raise RuntimeError("decord cannot read this")

    monkeypatch.setattr(video, "decord_reader", broken)
    assert read_frames(str(path), [3]).float().mean().item() == pytest.approx(18, abs=3)
    assert probe_video(str(path))["frames"] == 10  # frame count and fps from PyAV's header


def _windows(clips):
    return [(c.start_frame, c.num_frames, c.fps, list(c.frame_indices)) for c in clips]


def test_clip_strategies_on_a_real_video(tmp_path):
    """40 frames at 24 fps resampled to 8 fps: every third frame, 14 output frames."""
    info = probe_video(str(write_video(tmp_path / "v.mp4", 40, 24)))
    frames, fps = info["frames"], info["fps"]
    head = plan_clips(frames, fps, ClipPolicy(WAN, 8, "head"))
    assert _windows(head) == [(0, 13, 8.0, list(range(0, 37, 3)))]  # 13 = largest 4k+1 <= 14

    uniform = plan_clips(frames, fps, ClipPolicy((5, 9), 8, "uniform", clips_per_video=3))
    # 9 frames span 25 source frames; the 15 frames of room are split evenly: starts 0, 8 (7.5 rounds up), 15
    assert _windows(uniform) == [(s, 9, 8.0, list(range(s, s + 25, 3))) for s in (0, 8, 15)]

    slide = plan_clips(frames, fps, ClipPolicy((5,), 8, "slide", clip_stride=4))
    # stride 4 output frames = 12 source frames; a 5-frame window spans 13: starts 0, 12, 24 (36 + 13 > 40)
    assert _windows(slide) == [(s, 5, 8.0, [s, s + 3, s + 6, s + 9, s + 12]) for s in (0, 12, 24)]
    default_stride = plan_clips(frames, fps, ClipPolicy((5,), 8, "slide"))  # stride = clip length
    assert [c.start_frame for c in default_stride] == [0, 15]


def test_fractional_resampling_rounds_half_up_and_never_upsamples():
    # 12 -> 8 fps: 1.5 source frames per output frame
    (clip,) = plan_clips(13, 12, ClipPolicy((9,), 8, "head"))
    assert list(clip.frame_indices) == [0, 2, 3, 5, 6, 8, 9, 11, 12] and clip.fps == 8.0
    # 8 fps source, 16 fps target: kept at 8 fps, no repeated frames
    assert resample(8, 16) == (8.0, 1.0)
    (clip,) = plan_clips(12, 8, ClipPolicy((9,), 16, "head"))
    assert list(clip.frame_indices) == list(range(9)) and clip.fps == 8.0
    # target_fps None keeps the source rate
    (clip,) = plan_clips(5, 30, ClipPolicy((5,), None, "head"))
    assert list(clip.frame_indices) == [0, 1, 2, 3, 4] and clip.fps == 30.0


def test_uniform_gives_fewer_windows_when_the_video_has_no_room():
    clips = plan_clips(10, 8, ClipPolicy((9,), 8, "uniform", clips_per_video=4))
    assert [c.start_frame for c in clips] == [0, 1]  # only two distinct 9-frame windows in 10 frames
    (one,) = plan_clips(20, 8, ClipPolicy((9,), 8, "uniform", clips_per_video=1))
    assert one.start_frame == 5  # a single window is centred


def test_too_short_video_has_no_clip_and_a_reason():
    policy = ClipPolicy((5, 9), 8, "head")
    assert plan_clips(12, 24, policy) == []  # 12 frames at 24 fps = 4 frames at 8 fps
    reason = too_short_reason(12, 24, policy)
    assert "give 4 frames at 8 fps" in reason and "smallest bucket needs 5 frames" in reason


def test_scene_cut_is_detected_and_no_window_crosses_it(tmp_path):
    pytest.importorskip("scenedetect")
    path = write_video(tmp_path / "cut.mp4", 40, 12, cut=17)
    cuts = detect_cuts(str(path))
    assert cuts == [17]
    policy = ClipPolicy((5, 9), 8, "slide", clip_stride=2)
    crossing = [c for c in plan_clips(40, 12, policy) if c.start_frame < 17 < c.end_frame]
    assert crossing  # without scene splitting some windows do cross the cut
    clips = plan_clips(40, 12, policy, cuts)
    assert clips and all(c.end_frame <= 17 or c.start_frame >= 17 for c in clips)
    assert {c.start_frame < 17 for c in clips} == {True, False}  # clips on both sides
    # head with scene splitting: one clip per scene
    assert [c.start_frame for c in plan_clips(40, 12, ClipPolicy((5, 9), 8, "head"), cuts)] == [0, 17]
    # a clean video has no cut
    assert detect_cuts(str(write_video(tmp_path / "clean.mp4", 30, 12))) == []


def test_decoded_clip_frames_are_the_planned_source_frames(tmp_path):
    """What the cache stage does with a clip: read_frames(source_uri, clip.frame_indices)."""
    path = write_video(tmp_path / "v.mp4", 36, 24)
    (clip,) = plan_clips(36, 24, ClipPolicy((5, 9), 8, "uniform", clips_per_video=1))
    frames_FHWC = read_frames(str(path), clip.frame_indices)
    assert frames_FHWC.shape[0] == clip.num_frames == 9
    expected = torch.tensor([6.0 * i for i in clip.frame_indices])
    assert torch.allclose(frames_FHWC.float().mean(dim=(1, 2, 3)), expected, atol=3)


def test_file_urls_read_like_paths(tmp_path):
    path = write_video(tmp_path / "v.mp4", 12, 8)
    assert torch.equal(read_frames(f"file://{path}", [1, 2]), read_frames(str(path), [1, 2]))
    assert probe_video(f"file://{path}") == probe_video(str(path))


@pytest.mark.parametrize("rotation", [-90, 90, 180])
def test_a_rotated_phone_video_is_probed_and_read_upright(tmp_path, rotation):
    import numpy as np
    from latentmill.stages.video import probe_video, read_frames, video_rotation

    path = write_video(tmp_path / "phone.mp4", 6, 12, width=64, height=48, rotation=rotation, halves=True)
    meta = probe_video(str(path))
    shown = (48, 64) if rotation % 180 else (64, 48)
    assert (meta["width"], meta["height"], meta["rotation"], meta["frames"]) == (*shown, rotation, 6)
    assert video_rotation(str(path)) == rotation
    frames = read_frames(str(path), [0, 5, 0])
    assert frames.shape == (3, shown[1], shown[0], 3)
    # the coded frame: red left half, blue right half; shown turned `rotation` degrees counter-clockwise
    coded = np.zeros((48, 64), np.int16)
    coded[:, 32:] = 1
    expected_blue = np.rot90(coded, round(rotation / 90) % 4)
    got = frames[0].numpy().astype(np.int16)
    blue = got[..., 2] > got[..., 0]
    assert (blue == expected_blue.astype(bool)).mean() > 0.95
    assert torch.equal(frames[0], frames[2])
    # known rotation: the same frames without probing again; decord is refused (it returns garbage)
    assert torch.equal(read_frames(str(path), [0, 5, 0], rotation=rotation), frames)
    with pytest.raises(ValueError, match="decord cannot read a rotated video"):
        read_frames(str(path), [0], backend="decord")


def test_ingest_records_rotation_and_clips_decode_upright(tmp_path):
    from latentmill.stages import ingest
    from latentmill.stages.ingest import IngestConfig
    from latentmill.stages.shardio import StageDir
    from latentmill.stages.tarshard import read_shard
    from latentmill.stages.video import read_clip

    src = tmp_path / "videos"
    src.mkdir()
    write_video(src / "portrait.mp4", 9, 12, width=64, height=48, rotation=-90, halves=True)
    write_video(src / "landscape.mp4", 9, 12, width=64, height=48, halves=True)
    cfg = IngestConfig(source=str(src))
    sd = StageDir(tmp_path / "ingest", "ingest").ensure()
    records = [sd.run_unit(u, lambda unit, out: ingest.process(cfg, unit, out)) for u in ingest.plan(cfg)]
    metas = {m["source"]: m for r in records for s in r.shards
             for m in (json.loads(x["json"]) for x in read_shard(sd.root / s.path))}
    assert (metas["portrait.mp4"]["width"], metas["portrait.mp4"]["height"]) == (48, 64)
    assert metas["portrait.mp4"]["rotation"] == -90 and "rotation" not in metas["landscape.mp4"]
    clip = {"frame_indices": [0, 4, 8]}
    assert read_clip({**metas["portrait.mp4"], "clip": clip}).shape == (3, 64, 48, 3)
    assert read_clip({**metas["landscape.mp4"], "clip": clip}).shape == (3, 48, 64, 3)


def write_vfr_video(path: Path, gaps_ms: list[int]) -> Path:
    """Frame i is flat grey 6·i, shown for ``gaps_ms[i]`` milliseconds (a variable frame rate)."""
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1000)
        stream.options = {"threads": "1", "crf": "1", "bframes": "0"}
        pts = 0
        for i, gap in enumerate(gaps_ms):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 6 * i, np.uint8), format="rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
            pts += gap
        for packet in stream.encode():
            container.mux(packet)
    return path


GAPS_MS = [100] * 10 + [40] * 20 + [200] * 5  # 10 fps, then 25 fps, then 5 fps


def test_a_variable_frame_rate_video_is_cut_evenly_in_time(tmp_path):
    from latentmill.stages.video import ClipPolicy, frame_times, plan_clips_timed, probe_video

    path = write_vfr_video(tmp_path / "vfr.mp4", GAPS_MS)
    meta = probe_video(str(path))
    assert meta["vfr"] is True and meta["frames"] == 35
    times = frame_times(str(path))
    assert times == pytest.approx([sum(GAPS_MS[:i]) / 1000 for i in range(35)], abs=1e-3)
    assert "vfr" not in probe_video(str(write_video(tmp_path / "cfr.mp4", 24, 12)))

    policy = ClipPolicy(frame_counts=(5, 9, 13, 17, 21), target_fps=10.0)
    (clip,) = plan_clips_timed(times, meta["fps"], policy)
    assert clip.num_frames == 21 and clip.fps == 10.0
    for i, index in enumerate(clip.frame_indices):  # output frame i shows the frame on screen at i / 10 s
        t = i / 10
        assert times[index] <= t + 1e-3 and (index + 1 == len(times) or times[index + 1] > t + 1e-3)
    # the 25 fps stretch is thinned out, the 5 fps one repeats frames: 1.8 s and 1.9 s both show frame 30
    assert clip.frame_indices[10:] == (10, 12, 15, 17, 20, 22, 25, 27, 30, 30, 31)
    # the pixels come from those frames (grey 6·i)
    grey = read_frames(str(path), clip.frame_indices)[:, 0, 0, 0].tolist()
    assert all(abs(g - 6 * i) <= 3 for g, i in zip(grey, clip.frame_indices))

    # a scene cut at frame 20 (1.4 s): each scene is cut on its own, no clip crosses it
    clips = plan_clips_timed(times, meta["fps"], policy, cuts=[20])
    assert [c.frame_indices for c in clips] == [
        (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15),
        (20, 22, 25, 27, 30, 30, 31, 31, 32, 32, 33, 33, 34),
    ]


def test_the_bucket_stage_places_clips_of_a_vfr_video_by_time(tmp_path):
    from latentmill.stages import bucket, ingest
    from latentmill.stages.bucket import BucketConfig
    from latentmill.stages.ingest import IngestConfig
    from latentmill.stages.shardio import StageDir
    from latentmill.stages.tarshard import read_shard
    from latentmill.stages.video import frame_times, plan_clips_timed

    src = tmp_path / "videos"
    src.mkdir()
    path = write_vfr_video(src / "vfr.mp4", GAPS_MS)
    icfg = IngestConfig(source=str(src))
    ing = StageDir(tmp_path / "ingest", "ingest").ensure()
    ing.write_manifest([ing.run_unit(u, lambda unit, out: ingest.process(icfg, unit, out))
                        for u in ingest.plan(icfg)], {})
    bcfg = BucketConfig(resolution=64, target_fps=10.0, frame_counts=[5, 9, 13, 17, 21])
    bk = StageDir(tmp_path / "bucket", "bucket").ensure()
    records = [bk.run_unit(u, lambda unit, out: bucket.process(bcfg, unit, out)) for u in bucket.plan(bcfg, ing)]
    metas = [json.loads(s["json"]) for r in records for sh in r.shards for s in read_shard(bk.root / sh.path)]
    clips = [m["clip"] for m in metas]
    assert metas[0]["vfr"] is True
    expected = plan_clips_timed(frame_times(str(path)), metas[0]["fps"], bcfg.clip_policy())
    assert [c["frame_indices"] for c in clips] == [list(c.frame_indices) for c in expected]
    assert clips[0]["fps"] == 10.0 and len(clips[0]["frame_indices"]) == 21


def test_captioners_see_a_rotated_video_upright_with_the_probed_rotation(tmp_path, monkeypatch):
    from latentmill.stages import video as video_module
    from latentmill.stages.captioners.media import load_media
    from latentmill.stages.video import probe_video

    path = write_video(tmp_path / "phone.mp4", 12, 12, width=64, height=48, rotation=-90, halves=True)
    meta = {"kind": "video", "source_uri": str(path), **probe_video(str(path))}
    # ingest's probe already knows the rotation: the video is not opened again to find it
    monkeypatch.setattr(video_module, "video_rotation", lambda uri: pytest.fail("rotation probed again"))
    kind, images, indices = load_media({"__key__": "k"}, meta, frames=3, max_side=None)
    assert kind == "video" and len(images) == 3 and len(indices) == 3
    assert all(img.size == (48, 64) for img in images)  # shown size, not the coded 64x48
    top, bottom = images[0].getpixel((24, 4)), images[0].getpixel((24, 60))
    assert top[0] > top[2] and bottom[2] > bottom[0]  # red left half turned to the top


def test_probe_without_decord_counts_frames_after_reading_the_rotation(tmp_path, monkeypatch):
    from latentmill.stages import video as video_module

    path = write_video(tmp_path / "phone.mp4", 24, 12, rotation=90)
    with_decord = probe_video(str(path))

    def no_decord(src):
        raise RuntimeError("decord cannot open it")

    monkeypatch.setattr(video_module, "decord_reader", no_decord)
    assert probe_video(str(path)) == with_decord == {
        "width": 48, "height": 64, "fps": 12.0, "frames": 24, "duration": 2.0, "codec": "h264", "rotation": 90}
