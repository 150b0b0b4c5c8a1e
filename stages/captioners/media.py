"""Decoding what a captioner looks at: one image, or K frames sampled uniformly from a video clip.

A sample is a video when its JSON says ``"kind": "video"`` or it has a video member (``mp4``, ``webm``,
``mkv``, ``mov``); without a member, the video is read from its ``source_uri`` (ingest keeps videos as
references). Its optional clip window ``"clip": {"start_frame": S, "num_frames": N}`` limits where frames
are taken from (the whole video when absent). Frames are decoded by :func:`latentmill.stages.video.read_frames`
(decord, PyAV fallback) and shrunk to the model's input size right away, so memory per sample stays
bounded by K small frames whatever the video's resolution or length.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from latentmill.stages import pixels
from PIL import Image

VIDEO_MEMBERS = ("mp4", "webm", "mkv", "mov")

VideoSource = bytes | str | os.PathLike


def media_member(sample: dict[str, Any], meta: dict[str, Any]) -> tuple[str, str | None]:
    """``(kind, member)`` of a sample: ``("image", "jpg")``, ``("video", "mp4")``, or ``("video", None)`` for a
    video that ingest keeps as a reference (``source_uri``); ValueError when there is nothing to look at."""
    video = next((m for m in VIDEO_MEMBERS if m in sample), None)
    image = pixels.image_member(sample)
    if meta.get("kind") == "video" or (video and not image):
        if video is None and not meta.get("source_uri"):
            raise ValueError(f"video sample has no video member ({', '.join(VIDEO_MEMBERS)}) and no source_uri")
        return "video", video
    if image is None:
        raise ValueError(f"sample has no image member ({pixels.IMAGE_MEMBER!r}) or video member")
    return "image", image


def fit_within(img: Image.Image, max_side: int | None) -> Image.Image:
    """``img`` as RGB, shrunk (never enlarged) so that its longer side is at most ``max_side``: ``img`` itself
    when it is an RGB image that fits (callers pass images they own, fresh from a decoder; copying a
    decoded frame cost the curate stage a tenth of its per-image time)."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    size = fitted_size(img.size, max_side)
    return img if size == img.size else img.resize(size, Image.Resampling.BICUBIC)


def fitted_size(size: tuple[int, int], max_side: int | None) -> tuple[int, int]:
    """``size`` shrunk (never enlarged) so that its longer side is at most ``max_side``."""
    if not max_side or max(size) <= max_side:
        return size
    scale = max_side / max(size)
    return max(1, round(size[0] * scale)), max(1, round(size[1] * scale))


def load_image(data: bytes, max_side: int | None = None,
               background: tuple[int, int, int] = pixels.WHITE) -> Image.Image:
    """Decode an image by the decoding rules (:mod:`latentmill.stages.pixels`; JPEGs at reduced scale when that is
    enough) and fit it within ``max_side``."""
    return fit_within(pixels.decode_rgb(data, background, draft=max_side), max_side)


def load_image_alpha(data: bytes, max_side: int | None = None, background: tuple[int, int, int] = pixels.WHITE
                     ) -> tuple[Image.Image, Image.Image | None]:
    """:func:`load_image`'s image and its alpha (``L``, resized alike), or None when it has no transparency."""
    rgb, alpha = pixels.decode_rgb_alpha(data, background, draft=max_side)
    rgb = fit_within(rgb, max_side)
    if alpha is not None and alpha.size != rgb.size:
        alpha = alpha.resize(rgb.size, Image.Resampling.BICUBIC)
    return rgb, alpha


def frame_indices(total: int, start_frame: int = 0, num_frames: int | None = None, k: int = 8) -> list[int]:
    """``k`` frame indices spread uniformly over ``[start_frame, start_frame + num_frames)``.

    Index i is the centre of the i-th of k equal segments of the window, so the frames cover the whole
    clip and never sit on its very first or last frame unless the clip is that short. A window longer
    than the video is cut at its end; ``k`` larger than the window repeats frames.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if total < 1:
        raise ValueError("video has no frames")
    if not 0 <= start_frame < total:
        raise ValueError(f"clip start_frame {start_frame} is outside the video's {total} frames")
    window = total - start_frame if num_frames is None else min(num_frames, total - start_frame)
    if window < 1:
        raise ValueError(f"clip num_frames must be >= 1, got {num_frames}")
    return [start_frame + min(window - 1, int((i + 0.5) * window / k)) for i in range(k)]


def sample_frames_with_indices(
    video: VideoSource, start_frame: int = 0, num_frames: int | None = None, k: int = 8,
    max_side: int | None = None, backend: Literal["auto", "decord", "pyav"] = "auto",
    total_frames: int | None = None, rotation: int | None = None,
) -> tuple[list[Image.Image], list[int]]:
    """Like :func:`sample_frames`, also returning the frame index of each frame. ``total_frames`` and
    ``rotation``, when ingest probed them, save opening the video again to find them."""
    from latentmill.stages.video import probe_video, read_frames

    src = bytes(video) if isinstance(video, (bytes, bytearray)) else str(video)
    total = total_frames or probe_video(src)["frames"]
    indices = frame_indices(total, start_frame, num_frames, k)
    frames_KHWC = read_frames(src, indices, backend=backend, rotation=rotation).numpy()
    return [fit_within(Image.fromarray(frame), max_side) for frame in frames_KHWC], indices


def sample_frames(
    video: VideoSource, start_frame: int = 0, num_frames: int | None = None, k: int = 8,
    max_side: int | None = None, backend: Literal["auto", "decord", "pyav"] = "auto",
) -> list[Image.Image]:
    """``k`` RGB frames sampled uniformly from the clip window of a video (bytes, path or URI).

    Decoding is :func:`latentmill.stages.video.read_frames` (decord, PyAV fallback), the one video reader of the
    repository, so a captioner sees the frames the cache stage will encode.

    Args:
        video: The encoded video (bytes of an mp4/webm/mkv/mov file), a path, or any URI
            :mod:`latentmill.stages.video` opens (``file://``, fsspec URLs, ``tar://member::shard.tar``).
        start_frame: First frame of the clip window.
        num_frames: Length of the clip window in frames; None means up to the end of the video.
        k: How many frames to return (see :func:`frame_indices` for where they sit).
        max_side: Shrink every frame so that its longer side is at most this many pixels.
        backend: ``auto`` tries decord and falls back to PyAV; ``decord`` / ``pyav`` force one.
    """
    return sample_frames_with_indices(video, start_frame, num_frames, k, max_side, backend)[0]


def load_media(sample: dict[str, Any], meta: dict[str, Any], frames: int, max_side: int | None,
               background: tuple[int, int, int] = pixels.WHITE) -> tuple[str, list[Image.Image], list[int] | None]:
    """``("image", [img], None)`` or ``("video", K frames, their indices)`` for one sample; transparent
    pixels of an image are composited over ``background`` (``cache.alpha_background``)."""
    kind, member = media_member(sample, meta)
    if kind == "image":
        return kind, [load_image(sample[member], max_side, background)], None
    clip = meta.get("clip") or {}
    source = sample[member] if member else meta["source_uri"]
    # What ingest probed (the frame count, in read_frames' numbering, and the display rotation) saves
    # opening the video again.
    probed = bool(meta.get("frames"))
    total = int(meta["frames"]) if probed else None
    rotation = int(meta.get("rotation", 0)) if probed else None
    images, indices = sample_frames_with_indices(source, int(clip.get("start_frame") or 0), clip.get("num_frames"),
                                                 frames, max_side, total_frames=total, rotation=rotation)
    return kind, images, indices
