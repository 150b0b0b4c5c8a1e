"""Generate the embedded demo videos: small H.264 clips with sidecar captions, plus one broken file.

    python data/make_demo_videos.py data/demo/videos
    python data/make_demo_videos.py --audio data/demo/videos-audio

``--audio`` writes the audio families' demo set (LTX-2) into its own folder, leaving the set above unchanged:
64x64 clips at 24 fps with an AAC sound track, a sine tone whose pitch is named in the caption (so the audio
carries what the caption says), at 48, 44.1 and 22.05 kHz, mono and stereo; one video has no audio track (the
cache gives it silence).

Mixed sizes (landscape, portrait, wide), lengths (12 to 40 frames) and frame rates (8, 12, 24 fps), so
the video demo shows clip planning at work: one video has a hard cut in the middle (scene splitting
keeps clips on one side of it), one is too short for the smallest clip bucket after resampling to 8 fps
(the bucket stage quarantines it), and ``broken.mp4`` is not a video at all (ingest quarantines it).
One is per-clip curation's case: ``pause_64x48_8fps`` holds a frozen frame for its first 17 frames and
moves after, so of its two 17-frame clips one is still (motion 0) and one moves, and the demo recipe's
``curate.min_motion`` drops the still clip alone (the bucket stage quarantines it as ``<key>-c0``).

Every frame is drawn from its index alone and encoded with libx264 on one thread with fixed settings, so
the output is a pure function of this script and the PyAV/FFmpeg build: with the same build it is byte
for byte the same; another FFmpeg build may write other bytes, but the same frame counts, rates and sizes
(which is what the tests check).
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

COLORS = {
    "red": (220, 40, 40), "green": (40, 180, 70), "blue": (40, 80, 220), "yellow": (235, 210, 40),
    "purple": (140, 60, 190), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20),
}

# name: (width, height, frames, fps, [(first frame, fg, bg, motion)], caption, sidecar kind)
VIDEOS = {
    "ball_64x48_24fps": (64, 48, 40, 24, [(0, "red", "blue", "right")],
                         "a red square moving right on a blue background", "txt"),
    "tall_48x64_12fps": (48, 64, 24, 12, [(0, "yellow", "purple", "down")],
                         "a yellow square falling on a purple background, portrait video", "txt"),
    "wide_80x48_8fps": (80, 48, 32, 8, [(0, "white", "black", "right")],
                        "a white square crossing a black background, wide video", "json"),
    "cut_64x48_12fps": (64, 48, 36, 12, [(0, "orange", "blue", "right"), (18, "green", "white", "down")],
                        "an orange square on blue, then a hard cut to a green square on white", "txt"),
    "square_64x64_8fps": (64, 64, 20, 8, [(0, "green", "black", "diagonal")],
                          "a green square moving diagonally on a black background", "txt"),
    "short_64x48_24fps": (64, 48, 12, 24, [(0, "red", "white", "right")],
                          "a very short video of a red square", "txt"),
    # Frozen for 17 frames, then moving: with the demo's two 17-frame clips per video, one clip is still
    # (motion ~0) and one moves, and curate.min_motion drops the still one only.
    "pause_64x48_8fps": (64, 48, 34, 8, [(0, "black", "yellow", "still"), (17, "black", "yellow", "right")],
                         "a black square on yellow that stands still, then moves right", "txt"),
}
ENCODER_OPTIONS = {"threads": "1", "preset": "medium", "crf": "28", "g": "8", "bframes": "0"}


def frame(width: int, height: int, index: int, scenes: list[tuple[int, str, str, str]]) -> np.ndarray:
    """Frame ``index``: the scene it falls in, with its square moved by ``index``."""
    start, fg, bg, motion = [s for s in scenes if s[0] <= index][-1]
    t = index - start
    img = np.empty((height, width, 3), np.uint8)
    img[:] = COLORS[bg]
    side = min(width, height) // 3
    # "still": the square held where a "right" scene starts (x = 0), so a still scene can lead into one
    if motion in ("right", "diagonal"):
        x = (2 * t) % (width - side)
    else:
        x = 0 if motion == "still" else (width - side) // 2
    y = (2 * t) % (height - side) if motion in ("down", "diagonal") else (height - side) // 2
    img[y : y + side, x : x + side] = COLORS[fg]
    return img


def write_video(path: Path, width: int, height: int, frames: int, fps: float,
                scenes: list[tuple[int, str, str, str]]) -> None:
    """Encode ``frames`` frames at ``fps`` as H.264 in MP4 (yuv420p, one thread, fixed settings)."""
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(ENCODER_OPTIONS)
        for i in range(frames):
            image = av.VideoFrame.from_ndarray(frame(width, height, i, scenes), format="rgb24")
            for packet in stream.encode(image):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


# name: (frames, fg, bg, motion, tone in Hz or None for no audio track, sample rate, channels, caption)
AUDIO_VIDEOS = {
    "low_tone": (33, "red", "blue", "right", 220.0, 48000, 2,
                 "a red square moving right on blue, with a low hum"),
    "high_tone": (33, "yellow", "purple", "down", 1760.0, 44100, 1,
                  "a yellow square falling on purple, with a high whistle"),
    "mid_tone": (33, "green", "black", "diagonal", 660.0, 22050, 2,
                 "a green square moving diagonally on black, with a middle tone"),
    "silent": (33, "white", "black", "right", None, 48000, 2,
               "a white square crossing black, in silence"),
}


def write_audio_video(path: Path, frames: int, fps: int, scenes: list[tuple[int, str, str, str]],
                      tone: float | None, rate: int, channels: int) -> None:
    """A 64x64 H.264 video with (unless ``tone`` is None) an AAC track of a sine ``tone`` at ``rate`` Hz as
    long as the video, a tenth of full scale (a pure function of the arguments, as ``write_video``)."""
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        video.options = dict(ENCODER_OPTIONS)
        audio = None
        if tone is not None:
            audio = container.add_stream("aac", rate=rate)
            audio.layout = "stereo" if channels == 2 else "mono"
        for i in range(frames):
            for packet in video.encode(av.VideoFrame.from_ndarray(frame(64, 64, i, scenes), format="rgb24")):
                container.mux(packet)
        if audio is not None:
            n = round(frames / fps * rate)
            wave = (0.1 * np.sin(2 * np.pi * tone * np.arange(n) / rate)).astype(np.float32)
            planes = np.repeat(wave[None], channels, axis=0)
            for start in range(0, n, 1024):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(planes[:, start:start + 1024]),
                                                   format="fltp", layout=audio.layout.name)
                chunk.sample_rate, chunk.pts = rate, start
                for packet in audio.encode(chunk):
                    container.mux(packet)
            for packet in audio.encode():
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)


def generate_audio(out_dir: Path) -> list[Path]:
    """Write the audio demo set (``AUDIO_VIDEOS``) with sidecar captions; return the video paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (frames, fg, bg, motion, tone, rate, channels, caption) in AUDIO_VIDEOS.items():
        path = out_dir / f"{name}.mp4"
        write_audio_video(path, frames, 24, [(0, fg, bg, motion)], tone, rate, channels)
        path.with_suffix(".txt").write_text(caption + "\n")
        written.append(path)
    return written


def generate(out_dir: Path) -> list[Path]:
    """Write every demo video with its sidecar caption, plus ``broken.mp4``; return the video paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (width, height, frames, fps, scenes, caption, sidecar) in VIDEOS.items():
        path = out_dir / f"{name}.mp4"
        write_video(path, width, height, frames, fps, scenes)
        if sidecar == "json":
            path.with_suffix(".json").write_text(json.dumps({"caption": caption}) + "\n")
        else:
            path.with_suffix(".txt").write_text(caption + "\n")
        written.append(path)
    # Not a video at all: ingest probes the header and quarantines it.
    (out_dir / "broken.mp4").write_bytes(b"this is not an MP4 file\n" * 4)
    (out_dir / "broken.txt").write_text("a file that is not a video\n")
    return written


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--audio"]:
        target = Path(args[1]) if len(args) > 1 else Path(__file__).parent / "demo" / "videos-audio"
        print(f"wrote {len(generate_audio(target))} videos with sound to {target}")
    else:
        target = Path(args[0]) if args else Path(__file__).parent / "demo" / "videos"
        paths = generate(target)
        print(f"wrote {len(paths)} videos (+1 broken file) to {target}")
