"""Figure 10: every clip of a 10-minute video through the cache stage's decode path vs one sequential decode.

A 10-minute 854×480 H.264 video at 24 fps with a keyframe every 250 frames (generated once with PyAV into
``bench/.work/video/``, 1 minute with ``--quick``) is cut as the bucket stage cuts it with
``clip_strategy: slide``: 17-frame clips at 16 fps, one after the other (564 clips; 56 in a minute, the
issue's measurement). *Ours*: the frames of every clip as the cache stage gets them
(:class:`latentmill.stages.cache.SourcePasses`, one :func:`~latentmill.stages.video.read_clips` pass per
video; resizing to the bucket is left out, being the same work either way). *Baseline*: one sequential
decode of the same frames with the same backend, one open, frames converted to RGB only when needed and
then dropped. Figure 10 is decord (what ``read_frames``' ``auto`` picks for an unrotated video), 10b
PyAV (rotated videos and decord failures).

``details.per_clip``: the landed clip-by-clip path (``read_frames`` per clip) for context, timed on an
evenly spread subset of the clips and scaled to all of them. ``details.sparse``: eight 17-frame clips
spread over the first minute (gaps of many keyframe intervals): the one-pass reader (which seeks over a gap that
holds a keyframe) vs decoding straight through every frame from the first clip to the last (decord: every
frame also converted to RGB, decord having no decode-only skip that does not itself seek) vs clip by clip.

Run alone: ``python -m bench.video --quick``.
"""

from __future__ import annotations

import shutil
import statistics
import time
from fractions import Fraction
from pathlib import Path

from bench.common import WORK, figure, interleave, log, reps_of, run_benchmark, setup_env

setup_env()

WIDTH, HEIGHT, FPS, GOP = 854, 480, 24, 250
CLIP_FRAMES, TARGET_FPS = 17, 16.0


def make_video(seconds: int) -> Path:
    """The benchmark video (reused when it already exists): a panning pattern and a moving box, x264
    ``ultrafast`` (so that writing 10 minutes takes about a minute), CRF 23, no scene-cut keyframes."""
    import av
    import numpy as np

    path = WORK / "video" / f"long_{WIDTH}x{HEIGHT}_{FPS}fps_gop{GOP}_{seconds}s.mp4"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.mp4")
    log(f"video: writing {seconds} s of {WIDTH}x{HEIGHT} at {FPS} fps")
    yy, xx = np.mgrid[0:HEIGHT + 256, 0:WIDTH + 256]
    base = np.stack([xx % 256, (2 * yy) % 256, ((xx + yy) // 4) % 256], axis=-1).astype(np.uint8)
    with av.open(str(tmp), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(FPS))
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "23", "g": str(GOP), "keyint_min": str(GOP),
                          "sc_threshold": "0"}
        for i in range(seconds * FPS):
            dx, dy = (3 * i) % 256, (2 * i) % 256  # the pattern pans; a white box moves across it
            img = np.ascontiguousarray(base[dy: dy + HEIGHT, dx: dx + WIDTH])
            x0, y0 = (7 * i) % (WIDTH - 64), (5 * i) % (HEIGHT - 64)
            img[y0: y0 + 64, x0: x0 + 64] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.replace(path)
    return path


def clip_lists(frames: int) -> list[list[int]]:
    from latentmill.stages.video import ClipPolicy, plan_clips

    policy = ClipPolicy((CLIP_FRAMES,), TARGET_FPS, "slide")
    return [list(c.frame_indices) for c in plan_clips(frames, FPS, policy)]


def cache_path(path: Path, clips: list[list[int]], backend: str) -> int:
    """The cache stage's decode of every clip (decord: its own choice; PyAV: forced); frames decoded."""
    from latentmill.stages import video
    from latentmill.stages.cache import SourcePasses

    metas = [{"source_uri": str(path), "clip": {"frame_indices": c}, "rotation": 0} for c in clips]
    if backend == "pyav":  # what a rotated video or a decord failure gets
        gens = video.read_clips(str(path), clips, backend="pyav", rotation=0)
        return sum(len(next(gens)) for _ in clips)
    passes = SourcePasses(list(enumerate(metas)))
    return sum(len(passes.frames(i)) for i in range(len(clips)))


def sequential(path: Path, clips: list[list[int]], backend: str) -> int:
    """One open, one forward decode up to the last needed frame; needed frames converted, then dropped."""
    needed = sorted({f for c in clips for f in c})
    if backend == "decord":
        from latentmill.stages.video import decord_reader

        reader = decord_reader(str(path))
        n = 0
        # a clip's worth at a time: bounded memory, as ours, and the fastest here (a 64 or 256-frame batch
        # took 1.5-2.5x as long: fresh hundreds of MB per call)
        for s in range(0, len(needed), CLIP_FRAMES):
            n += len(reader.get_batch(needed[s: s + CLIP_FRAMES]).asnumpy())
        return n
    import av

    wanted, last, n = set(needed), needed[-1], 0
    with av.open(str(path)) as container:
        for k, frame in enumerate(container.decode(video=0)):
            if k in wanted:
                frame.to_ndarray(format="rgb24")
                n += 1
            if k >= last:
                break
    return n


def per_clip(path: Path, clips: list[list[int]], backend: str, subset: int) -> dict:
    """Clip by clip with read_frames on ``subset`` clips spread evenly; seconds scaled to all clips."""
    from latentmill.stages.video import read_frames

    picks = [clips[round(k * (len(clips) - 1) / max(1, subset - 1))] for k in range(subset)]
    start = time.perf_counter()
    for clip in picks:
        read_frames(str(path), clip, backend=backend, rotation=0)
    seconds = time.perf_counter() - start
    return {"clips_timed": len(picks), "seconds_timed": round(seconds, 3),
            "seconds_all_clips": round(seconds / len(picks) * len(clips), 2)}


def _timer(fn):
    def run(_rep: int) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def run(args) -> list:
    seconds = 60 if args.quick else 600
    reps = reps_of(args, full=2, quick=2)  # a full decord pass of 10 minutes: ~1 min here
    path = make_video(seconds)
    frames = seconds * FPS
    clips = clip_lists(frames)
    needed = len({f for c in clips for f in c})
    inputs = {"video": {"width": WIDTH, "height": HEIGHT, "fps": FPS, "seconds": seconds, "frames": frames,
                        "keyframe_interval": GOP, "codec": "h264 (x264 ultrafast, crf 23)",
                        "bytes": path.stat().st_size},
              "clips": {"count": len(clips), "frames": CLIP_FRAMES, "fps": TARGET_FPS, "strategy": "slide",
                        "source_frames_needed": needed}}
    figures = []
    for backend, label in (("decord", "12"), ("pyav", "12b")):
        assert cache_path(path, clips[:3], backend) == 3 * CLIP_FRAMES
        ours, base = interleave(reps, _timer(lambda b=backend: cache_path(path, clips, b)),
                                _timer(lambda b=backend: sequential(path, clips, b)), f"video {backend}")
        base_median = statistics.median(base)
        old = per_clip(path, clips, backend, subset=24 if backend == "decord" else (4 if args.quick else 3))
        old["ratio_vs_sequential"] = round(old["seconds_all_clips"] / base_median, 2)
        log(f"video {backend}: clip by clip {old}")
        details = {"per_clip": old}
        if backend == "decord":
            details["sparse"] = sparse(path, frames)
        figures.append(figure(
            f"{label}. all clips of a {seconds // 60}-minute 480p video vs one sequential decode ({backend})",
            ours, base, "s", "<= 1.5", inputs | {"backend": backend},
            "ours: the cache stage's decode of every clip (one pass per video, frames kept about one clip at a "
            "time); baseline: one forward decode of the same frames; details.per_clip: the landed clip-by-clip "
            "read_frames, for context", details=details))
    return figures


def sparse(path: Path, frames: int) -> dict:
    """Eight clips spread over the video: one pass with seeks over keyframe gaps, decoding straight
    through, clip by clip (decord and PyAV; one repetition each)."""
    from latentmill.stages.video import read_clips, read_frames

    span, frames = clip_lists(frames)[0], min(frames, 60 * FPS)  # the first minute: straight through is slow
    starts = [round(k * (frames - span[-1] - 1) / 7) for k in range(8)]
    clips = [[s + f for f in span] for s in starts]
    out: dict = {"clips": len(clips), "starts": starts}
    for backend in ("decord", "pyav"):
        row = {}
        for name, fn in (
            ("one_pass_with_seeks", lambda b=backend: list(read_clips(str(path), clips, backend=b, rotation=0))),
            ("decode_straight_through", lambda b=backend: sequential(path, [list(range(starts[0],
                                                                                        clips[-1][-1] + 1))], b)),
            ("clip_by_clip", lambda b=backend: [read_frames(str(path), c, backend=b, rotation=0) for c in clips]),
        ):
            start = time.perf_counter()
            fn()
            row[name] = round(time.perf_counter() - start, 3)
        out[backend] = row
        log(f"video sparse {backend}: {row}")
    return out


def run_and_clean(args) -> list:
    figures = run(args)
    if not args.keep and not args.quick:
        shutil.rmtree(WORK / "video", ignore_errors=True)
    return figures


def main(argv=None) -> None:
    run_benchmark("video", __doc__, run_and_clean, argv)


if __name__ == "__main__":
    main()
