"""What a motion score costs per clip, for the options the curate stage could use (issue 18's justification).

A 5-second 640x360 H.264 clip at 24 fps (a textured scene panning 2 px a frame, libx264 at crf 23, one
keyframe) is written with PyAV under ``bench/.work/motion/``. Per clip, median of ``--reps`` runs:

* ``decode_k``: the K = 4 frames the curate stage decodes anyway (``load_media`` at ``score_side`` 256,
  i.e. ``read_frames``): what every score pays, motion or not;
* ``diff``: the chosen score, mean |difference| of consecutive grey frames among those K frames (numpy);
* ``decode_pairs``: what any flow-style score needs on top: K pairs of *adjacent* frames (2K frames, same
  reader), since frames seconds apart do not give a flow;
* ``phase``: global translation per adjacent pair by phase correlation (numpy FFT, 256 px side);
* ``blocks``: a dense block-matching flow per adjacent pair (8 px blocks, +-4 px search, numpy), the
  Farneback-free stand-in for optical flow (cv2 is not installed).

Run: ``python -m bench.curate_motion [--reps N]``; prints one JSON object (seconds per clip).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

WORK = Path(__file__).resolve().parent / ".work" / "motion"
K, SIDE = 4, 256


def write_clip(path: Path, frames: int = 120, width: int = 640, height: int = 360, step: int = 2) -> Path:
    import av
    from PIL import Image

    rng = np.random.RandomState(0)
    texture = np.asarray(Image.fromarray(rng.randint(0, 256, (height // 8, (width + frames * step) // 8, 3),
                                                     np.uint8)).resize((width + frames * step, height),
                                                                       Image.Resampling.BICUBIC))
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(24))
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        stream.options = {"crf": "23", "threads": "1"}
        for i in range(frames):
            frame = np.ascontiguousarray(texture[:, i * step:i * step + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def grey(img) -> np.ndarray:
    return np.asarray(img.convert("L"), np.float64)


def phase_shift(a: np.ndarray, b: np.ndarray) -> float:
    """Length of the global translation from a to b by phase correlation."""
    cross = np.fft.rfft2(a) * np.conj(np.fft.rfft2(b))
    corr = np.fft.irfft2(cross / np.maximum(np.abs(cross), 1e-9), s=a.shape)
    dy, dx = np.unravel_index(int(np.argmax(corr)), corr.shape)
    dy = dy - a.shape[0] if dy > a.shape[0] // 2 else dy
    dx = dx - a.shape[1] if dx > a.shape[1] // 2 else dx
    return float(np.hypot(dy, dx))


def block_flow(a: np.ndarray, b: np.ndarray, block: int = 8, radius: int = 4) -> float:
    """Mean length of the per-block displacement minimising the sum of absolute differences."""
    h, w = (a.shape[0] // block) * block, (a.shape[1] // block) * block
    a, pad = a[:h, :w], np.pad(b[:h, :w], radius, mode="edge")
    best = np.full((h // block, w // block), np.inf)
    length = np.zeros_like(best)
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            shifted = pad[radius + dy:radius + dy + h, radius + dx:radius + dx + w]
            sad = np.abs(a - shifted).reshape(h // block, block, w // block, block).sum(axis=(1, 3))
            better = sad < best
            best[better], length[better] = sad[better], np.hypot(dy, dx)
    return float(length.mean())


def measure(reps: int) -> dict:
    from latentmill.stages.captioners.media import fit_within, frame_indices
    from latentmill.stages.curate_models import motion
    from latentmill.stages.video import read_frames
    from PIL import Image

    WORK.mkdir(parents=True, exist_ok=True)
    clip = write_clip(WORK / "pan.mp4")
    total = 120
    spread = frame_indices(total, 0, None, K)
    pairs = sorted({j for i in spread for j in (i, min(i + 1, total - 1))})

    def decode(indices):
        return [grey(fit_within(Image.fromarray(f), SIDE)) for f in read_frames(str(clip), indices).numpy()]

    times: dict[str, list[float]] = {k: [] for k in ("decode_k", "diff", "decode_pairs", "phase", "blocks")}
    values: dict[str, float] = {}
    for _ in range(reps):
        t = time.perf_counter()
        frames = decode(spread)
        times["decode_k"].append(time.perf_counter() - t)
        t = time.perf_counter()
        values["diff"] = motion(frames)
        times["diff"].append(time.perf_counter() - t)
        t = time.perf_counter()
        adjacent = decode(pairs)
        times["decode_pairs"].append(time.perf_counter() - t)
        couples = list(zip(adjacent[0::2], adjacent[1::2]))
        t = time.perf_counter()
        values["phase"] = float(np.mean([phase_shift(a, b) for a, b in couples]))
        times["phase"].append(time.perf_counter() - t)
        t = time.perf_counter()
        values["blocks"] = float(np.mean([block_flow(a, b) for a, b in couples]))
        times["blocks"].append(time.perf_counter() - t)
    return {"clip": "640x360, 120 frames, 24 fps, H.264 crf 23, panning 2 px/frame", "k": K, "side": SIDE,
            "reps": reps, "seconds_per_clip": {k: round(statistics.median(v), 5) for k, v in times.items()},
            "values": {k: round(v, 3) for k, v in values.items()},
            "note": "values: diff in grey levels; phase and blocks in pixels per frame at the 256 px side "
                    "(the pan is 2 px/frame at 640 px, 0.8 at 256)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    print(json.dumps(measure(parser.parse_args().reps), indent=1))


if __name__ == "__main__":
    main()
