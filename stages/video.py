"""Video: header probing, frame reading, clip planning and scene cuts. The one video implementation.

* :func:`probe_video` reads what ingest records (fps, frame count, size, duration, codec, display
  rotation) from the container: decord for the frame count and fps (the numbering :func:`read_frames`
  uses), PyAV for the size, codec name and rotation (decord exposes none of them without decoding a frame).
  A rotated (phone) video is recorded with its displayed size, and :func:`read_frames` turns its frames
  upright.
* :func:`read_frames` decodes chosen frames as ``uint8 [F, H, W, 3]`` (decord first, PyAV when decord
  cannot read the stream). Captioners decode with it.
* :func:`read_clips` decodes many clips of one video in one forward pass (one open, a seek only where a
  keyframe lies in a gap between needed frames), with exactly :func:`read_frames`'s pixels per clip. The
  cache stage decodes the clips of each source video in a work unit with it: clip by clip, a long video
  cost one open and one seek-and-decode per clip (11× the sequential pass with decord, 32× with PyAV).
* :func:`plan_clips` turns a video's length and fps into training clips: a window of source frames,
  resampled to the target fps, whose length is one of the model family's admissible frame counts
  (``4k+1`` for Wan-class), placed by a strategy (``head``, ``uniform``, ``slide``) and never across a
  scene cut (:func:`detect_cuts`, PySceneDetect).

A clip is a reference (source, start frame, frame count, fps, frame indices), never a re-encoded copy.
A URI is a local path, a ``file://`` URL or any fsspec URL (``http(s)://``, ``s3://``, and
``tar://member::shard.tar`` for a video inside a webdataset shard); non-local sources are read into
memory once per call.
"""

from __future__ import annotations

import bisect
import functools
import io
import math
import threading
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Sequence

import numpy as np

if TYPE_CHECKING:  # torch is imported by the functions that make tensors: a recipe loads without it
    import torch

VIDEO_EXTENSIONS = {".mp4": "mp4", ".webm": "webm", ".mkv": "mkv", ".mov": "mov", ".avi": "avi", ".m4v": "mp4"}
CLIP_STRATEGIES = ("head", "uniform", "slide")

# ---------------------------------------------------------------------------------------------------------
# Opening a source
# ---------------------------------------------------------------------------------------------------------


def local_path(uri: str) -> str | None:
    """The filesystem path of a local ``uri`` (plain path or ``file://``), None for anything remote."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if "://" in uri or "::" in uri:
        return None
    return uri


def read_uri_bytes(uri: str) -> bytes:
    """All bytes of ``uri`` (local path or fsspec URL)."""
    path = local_path(uri)
    if path is not None:
        with open(path, "rb") as fh:
            return fh.read()
    import fsspec

    with fsspec.open(uri, "rb") as fh:
        return fh.read()


def _source(uri: str | bytes) -> str | bytes:
    """A path decord / PyAV open directly, or the bytes of a remote video."""
    if isinstance(uri, (bytes, bytearray)):
        return bytes(uri)
    path = local_path(str(uri))
    return path if path is not None else read_uri_bytes(str(uri))


def _open_arg(src: str | bytes) -> Any:
    return io.BytesIO(src) if isinstance(src, bytes) else src


# Decoder opens (``decord``, ``pyav``) and explicit seeks (``pyav_seek``) by the frame readers of this process,
# and the most decoded frames one read_clips pass held at once (``held_peak``): what the tests check (a unit's
# clips of one video cost one open; memory stays about one clip's frames) and what benchmarks report.
DECODE_COUNTS: Counter[str] = Counter()
_counts_lock = threading.Lock()


def _count(what: str) -> None:
    with _counts_lock:
        DECODE_COUNTS[what] += 1


def _peak(what: str, value: int) -> None:
    with _counts_lock:
        DECODE_COUNTS[what] = max(DECODE_COUNTS[what], value)


def _open_av(src: str | bytes) -> Any:
    """A PyAV input container on ``src``, counted in :data:`DECODE_COUNTS`."""
    import av

    _count("pyav")
    return av.open(_open_arg(src))


def open_media(uri: str | bytes) -> Any:
    """A PyAV input container on a video's URI (a local path, a remote URL's bytes) or bytes."""
    return _open_av(_source(uri))


# ---------------------------------------------------------------------------------------------------------
# Probing
# ---------------------------------------------------------------------------------------------------------


def decord_reader(src: str | bytes):
    """A quiet, single-threaded ``decord.VideoReader`` on ``src`` (a path, URI or the bytes), counted as a decord open."""
    import decord

    _quiet_decord()
    _count("decord")
    return decord.VideoReader(_open_arg(src), ctx=decord.cpu(0), num_threads=1)


@functools.lru_cache(maxsize=1)
def _quiet_decord() -> None:
    """No FFmpeg chatter from decord's own FFmpeg: a file it cannot read falls back to PyAV, which says why."""
    import decord.logging

    decord.logging.set_level(decord.logging.QUIET)


def probe_video(uri: str | bytes) -> dict[str, Any]:
    """Header facts of a video: ``width, height, fps, frames, duration, codec``.

    Raises ValueError with a readable reason when the file has no decodable video stream or no frames.
    """
    import av

    src = _source(uri)
    frames = fps = None
    times: list[float] | None = None
    # PyAV first: a file it cannot open is not a video, and is quarantined without decord ever seeing it
    # (decord prints an ERROR line of its own for every file it cannot open).
    try:
        with av.open(_open_arg(src)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            codec = stream.codec_context.name
            rotation = _first_frame_rotation(container)
    except av.FFmpegError as err:
        raise ValueError(f"not a readable video: {err}") from None
    try:
        reader = decord_reader(src)
        frames, fps = len(reader), float(reader.get_avg_fps())
        times = [float(t) for t in reader.get_frame_timestamp(range(frames))[:, 0]] if frames else None
        del reader
    except Exception:  # decord raises RuntimeError / DECORDError / AssertionError: PyAV counts below
        pass
    if frames is None:
        try:
            with av.open(_open_arg(src)) as container:
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate
                fps = float(rate) if rate else 0.0
                frames = stream.frames or sum(1 for p in container.demux(stream) if p.size)
        except av.FFmpegError as err:
            raise ValueError(f"not a readable video: {err}") from None
    if not frames or frames < 1:
        raise ValueError("video has no frames")
    if not fps or fps <= 0 or not math.isfinite(fps):
        raise ValueError(f"video has no usable frame rate ({fps})")
    if not width or not height:
        raise ValueError(f"video has a degenerate size {width}x{height}")
    if rotation % 180:
        width, height = height, width  # the size as the video is shown (and as read_frames returns it)
    meta = {"width": int(width), "height": int(height), "fps": round(fps, 6), "frames": int(frames),
            "duration": round(frames / fps, 6), "codec": codec}
    if rotation:
        meta["rotation"] = rotation
    if times is not None and is_variable_rate(times, fps):
        meta["vfr"] = True  # clips are placed by frame time (plan_clips_timed), not by frame index
    return meta


def is_variable_rate(times: Sequence[float], fps: float) -> bool:
    """Whether frame times drift from a constant ``fps`` grid by more than half a frame."""
    if len(times) < 3 or fps <= 0:
        return False
    t0 = times[0]
    return max(abs(t - t0 - i / fps) for i, t in enumerate(times)) > 0.5 / fps


def frame_times(uri: str | bytes) -> list[float]:
    """Presentation time (seconds) of every frame, in frame-index order (decord's index; PyAV's packets
    when decord cannot open the file)."""
    src = _source(uri)
    try:
        reader = decord_reader(src)
        return [float(t) for t in reader.get_frame_timestamp(range(len(reader)))[:, 0]]
    except Exception:
        import av

        with av.open(_open_arg(src)) as container:
            stream = container.streams.video[0]
            pts = sorted(p.pts for p in container.demux(stream) if p.size and p.pts is not None)
            return [float(t * stream.time_base) for t in pts]


def video_rotation(uri: str | bytes) -> int:
    """The display rotation of a video, in degrees counter-clockwise (0, 90, 180 or -90).

    Phones store portrait video as landscape frames plus a display matrix; players turn the frames by it
    (``-90``: a quarter turn clockwise). This is FFmpeg's ``av_display_rotation_get`` of the first frame,
    rounded to a quarter turn; 0 when the file has no display matrix or PyAV cannot tell.
    """
    import av

    try:
        with av.open(_open_arg(_source(uri))) as container:
            return _first_frame_rotation(container) if container.streams.video else 0
    except (av.FFmpegError, ValueError, OSError):
        return 0


def _first_frame_rotation(container: Any) -> int:
    """:func:`video_rotation` of an open PyAV container (0 when its first frame cannot be decoded)."""
    import av

    try:
        frame = next(iter(container.decode(video=0)), None)
    except (av.FFmpegError, ValueError):
        return 0
    angle = getattr(frame, "rotation", 0) or 0 if frame is not None else 0
    if not math.isfinite(angle):
        return 0
    return {0: 0, 1: 90, 2: 180, 3: -90}[round(angle / 90) % 4]


def rotate_frames(frames_FHWC: torch.Tensor, rotation: int) -> torch.Tensor:
    """Frames turned as the display matrix says (``rotation`` degrees counter-clockwise)."""
    import torch

    k = round(rotation / 90) % 4
    return torch.rot90(frames_FHWC, k, dims=(1, 2)).contiguous() if k else frames_FHWC


# ---------------------------------------------------------------------------------------------------------
# Reading frames
# ---------------------------------------------------------------------------------------------------------


def _read_decord(src: str | bytes, unique: list[int]) -> torch.Tensor:
    import torch

    reader = decord_reader(src)
    if unique[-1] >= len(reader):
        raise IndexError(f"frame {unique[-1]} is past the end of the video ({len(reader)} frames)")
    return torch.from_numpy(reader.get_batch(unique).asnumpy())


def _read_pyav(src: str | bytes, unique: list[int]) -> torch.Tensor:
    import torch

    wanted, last = set(unique), unique[-1]
    found: dict[int, torch.Tensor] = {}
    with _open_av(src) as container:
        for n, frame in enumerate(container.decode(video=0)):
            if n in wanted:
                found[n] = torch.from_numpy(frame.to_ndarray(format="rgb24"))
            if n >= last:
                break
    missing = [i for i in unique if i not in found]
    if missing:
        raise IndexError(f"video ended before frame {missing[0]} ({len(found)} of {len(unique)} frames read)")
    return torch.stack([found[i] for i in unique])


def read_frames(uri: str | bytes, frame_indices: Sequence[int],
                backend: Literal["auto", "decord", "pyav"] = "auto", rotation: int | None = None) -> torch.Tensor:
    """Decode the frames ``frame_indices`` (any order, repeats allowed) as ``uint8 [F, H, W, 3]`` RGB.

    ``auto`` reads with decord and falls back to PyAV when decord cannot open or decode the stream; an
    index past the end of the video raises IndexError from either backend. Frames come out upright, turned
    by the video's display rotation (``rotation``, as :func:`probe_video` recorded it; ``None`` reads it
    from the file). A rotated video is always read with PyAV: decord 0.6.0 (and decord2 3.4) return
    garbage or fail on one.
    """
    import torch

    indices = [int(i) for i in frame_indices]
    if not indices:
        raise ValueError("frame_indices is empty")
    if min(indices) < 0:
        raise IndexError(f"negative frame index {min(indices)}")
    unique = sorted(set(indices))
    src = _source(uri)
    if rotation is None:
        rotation = video_rotation(src)
    frames_UHWC = None
    if backend == "decord" and rotation:
        raise ValueError(f"decord cannot read a rotated video (display rotation {rotation}); use backend 'pyav'")
    if backend in ("auto", "decord") and not rotation:
        try:
            frames_UHWC = _read_decord(src, unique)
        except IndexError:
            raise
        except Exception:
            if backend == "decord":
                raise
    if frames_UHWC is None:
        frames_UHWC = rotate_frames(_read_pyav(src, unique), rotation)
    position = {i: n for n, i in enumerate(unique)}
    return frames_UHWC[torch.tensor([position[i] for i in indices])]


# ---------------------------------------------------------------------------------------------------------
# Many clips of one video: one forward pass
# ---------------------------------------------------------------------------------------------------------


class _DecordPass:
    """Forward reads with one decord reader. decord skips a gap by seeking to the last keyframe before the
    next wanted frame when a keyframe lies in the gap (``VideoReader::SkipFrames``), else decodes through
    it: the same rule as :class:`_PyAVPass`."""

    def __init__(self, src: str | bytes):
        self.reader = decord_reader(src)
        self.length: int | None = len(self.reader)

    def fetch(self, frames: list[int]) -> dict[int, np.ndarray]:
        batch_FHWC = self.reader.get_batch(frames).asnumpy()
        return {f: batch_FHWC[j] for j, f in enumerate(frames)}

    def close(self) -> None:
        self.reader = None


class _PyAVPass:
    """Forward reads with one PyAV container.

    Frames are numbered as :func:`_read_pyav` numbers them (the n-th decoded frame is frame n): by their
    rank among the packets' presentation times, read from one demux pass (no decoding) that also lists the
    keyframes. The decoder seeks to the last keyframe at or before the next wanted frame when that keyframe
    lies after the last decoded frame (decoding from it skips the gap; decoding through the gap would only
    cost more), else decodes on. A stream whose packets lack or repeat presentation times is decoded from
    the start and counted frame by frame, exactly as :func:`_read_pyav` does (a second open).
    """

    def __init__(self, src: str | bytes):
        self.src = src
        self.container = _open_av(src)
        if not self.container.streams.video:
            self.container.close()
            raise ValueError("no video stream")
        self.stream = self.container.streams.video[0]
        self.length: int | None = None  # known only at the end of the stream, as for _read_pyav
        pts: list[int] = []
        key_pts: list[int] = []
        sound = True
        for packet in self.container.demux(self.stream):
            if not packet.size:
                continue
            if packet.pts is None:
                sound = False
                break
            pts.append(packet.pts)
            if packet.is_keyframe:
                key_pts.append(packet.pts)
        self.rank: dict[int, int] | None = None
        if sound and len(set(pts)) == len(pts):
            self.rank = {p: n for n, p in enumerate(sorted(pts))}
            self.keyframes = sorted(self.rank[p] for p in key_pts) or [0]
            self.key_pts = {self.rank[p]: p for p in key_pts}
        self.frames: Iterator[Any] | None = None
        self.pos = -1  # the last frame decoded
        self.floor = 0  # frames before it come from before the keyframe sought to: not ours to number
        self.sought = False  # no frame decoded since the last seek
        self.ended = False

    def _next(self) -> int | None:
        """Decode one frame; its number (None at the end of the stream), leaving it in ``self.frame``."""
        assert self.frames is not None
        while True:
            frame = next(self.frames, None)
            if frame is None:
                self.ended = True
                return None
            if self.rank is None:
                n = self.pos + 1
            else:
                if frame.pts not in self.rank:
                    raise RuntimeError(f"decoded a frame with presentation time {frame.pts} that no packet has")
                n = self.rank[frame.pts]
                if self.sought and n > self.floor:  # the seek overshot the keyframe: frames would be lost
                    raise RuntimeError(f"seeking to frame {self.floor} landed on frame {n}")
                if n < self.floor:
                    continue
                self.sought = False
            self.frame, self.pos = frame, n
            return n

    def _position(self, target: int) -> None:
        """Seek when a keyframe lies after the last decoded frame and at or before ``target``."""
        if self.rank is None:
            if self.frames is None:  # the demux pass consumed the container: decode from a fresh open
                self.container.close()
                self.container = _open_av(self.src)
                self.frames = iter(self.container.decode(video=0))
            return
        key = self.keyframes[max(0, bisect.bisect_right(self.keyframes, target) - 1)]
        if self.frames is None or key > self.pos + 1:
            _count("pyav_seek")
            self.container.seek(self.key_pts.get(key, 0), stream=self.stream, backward=True, any_frame=False)
            self.frames = iter(self.container.decode(self.stream))
            self.floor, self.pos, self.sought = key, key - 1, True

    def fetch(self, frames: list[int]) -> dict[int, np.ndarray]:
        found: dict[int, np.ndarray] = {}
        wanted = set(frames)
        for f in frames:
            if self.ended:
                break
            if f <= self.pos:
                continue
            self._position(f)
            while (n := self._next()) is not None:
                if n in wanted:
                    found[n] = self.frame.to_ndarray(format="rgb24")
                if n >= f:
                    break
        return found

    def close(self) -> None:
        self.container.close()


def read_clips(uri: str | bytes, clips: Sequence[Sequence[int]],
               backend: Literal["auto", "decord", "pyav"] = "auto",
               rotation: int | None = None) -> Iterator[torch.Tensor | Exception]:
    """For each clip (a list of frame indices) of one video, in the given order, what
    ``read_frames(uri, clip, backend, rotation)`` returns, or the exception it raises, as a value.

    The video is opened once and decoded forward from the keyframe before the first wanted frame to the
    last wanted one; a gap between wanted frames that spans a keyframe is skipped by a seek. A clip is
    yielded as soon as its last frame is decoded, and a frame is dropped as soon as no clip still to come
    needs it: with clips listed in time order, the frames held are about one clip's. Clips listed out of
    time order are still right, holding the frames decoded early for the clips that wait. Should the pass
    fail midway (a damaged stream), the clips not yet yielded are read one by one with :func:`read_frames`
    and so end as they always did.
    """
    lists = [[int(i) for i in clip] for clip in clips]
    src = _source(uri)
    if rotation is None:
        rotation = video_rotation(src)
    errors: dict[int, Exception] = {}
    for k, clip in enumerate(lists):
        if not clip:
            errors[k] = ValueError("frame_indices is empty")
        elif min(clip) < 0:
            errors[k] = IndexError(f"negative frame index {min(clip)}")
        elif backend == "decord" and rotation:
            errors[k] = ValueError(f"decord cannot read a rotated video (display rotation {rotation}); "
                                   "use backend 'pyav'")
    if len(errors) == len(lists):
        yield from (errors[k] for k in range(len(lists)))
        return
    decoder: _DecordPass | _PyAVPass | None = None
    try:
        if backend in ("auto", "decord") and not rotation:
            try:
                decoder = _DecordPass(src)
            except Exception:
                if backend == "decord":
                    raise
        if decoder is None:
            decoder = _PyAVPass(src)
    except Exception as err:  # the video cannot be opened: every clip fails as read_frames would
        yield from (errors.get(k, err) for k in range(len(lists)))
        return
    try:
        yield from _clips_in_one_pass(decoder, src, lists, errors, backend, rotation)
    finally:
        decoder.close()


def _clips_in_one_pass(decoder: _DecordPass | _PyAVPass, src: str | bytes, lists: list[list[int]],
                       errors: dict[int, Exception], backend: Literal["auto", "decord", "pyav"],
                       rotation: int) -> Iterator[torch.Tensor | Exception]:
    import torch

    for k, clip in enumerate(lists):
        if k not in errors and decoder.length is not None and max(clip) >= decoder.length:
            errors[k] = IndexError(f"frame {max(clip)} is past the end of the video ({decoder.length} frames)")
    last_use = {f: k for k, clip in enumerate(lists) if k not in errors for f in clip}
    needed = sorted(last_use)
    held: dict[int, np.ndarray] = {}
    done = 0  # needed[:done] were decoded (or looked for)
    failed = False
    for k, clip in enumerate(lists):
        if k in errors:
            yield errors[k]
            continue
        if failed:
            yield _read_one(src, clip, backend, rotation)
            continue
        upto = bisect.bisect_right(needed, max(clip))
        if upto > done:
            try:
                held.update(decoder.fetch(needed[done:upto]))
                _peak("held_peak", len(held))
            except Exception:  # a damaged stream: the rest, clip by clip, as before
                failed = True
                held.clear()
                yield _read_one(src, clip, backend, rotation)
                continue
            done = upto
        missing = [f for f in sorted(set(clip)) if f not in held]
        if missing:
            yield IndexError(f"video ended before frame {missing[0]} "
                             f"({len(clip) - len(missing)} of {len(clip)} frames read)")
        else:
            # numpy, not torch.stack: torch's threaded copy was 20-40x slower on a loaded 2-core machine
            yield rotate_frames(torch.from_numpy(np.stack([held[f] for f in clip])), rotation)
        for f in clip:
            if last_use.get(f) == k:
                held.pop(f, None)


def _read_one(src: str | bytes, clip: list[int], backend: Literal["auto", "decord", "pyav"],
              rotation: int) -> torch.Tensor | Exception:
    try:
        return read_frames(src, clip, backend, rotation)
    except Exception as err:
        return err


# ---------------------------------------------------------------------------------------------------------
# Clips
# ---------------------------------------------------------------------------------------------------------


def admissible_frame_counts(frame_step: int = 4, max_frames: int = 81, include_one: bool = False) -> list[int]:
    """``frame_step·k + 1`` up to ``max_frames``: 5, 9, …, 81 for Wan-class (4× temporal VAE)."""
    return [n for n in range(1 if include_one else frame_step + 1, max_frames + 1, frame_step)]


@dataclass(frozen=True)
class ClipPolicy:
    """How clips are cut from a video (built from ``bucket.*`` keys by ``BucketConfig.clip_policy``)."""

    frame_counts: tuple[int, ...]  # admissible clip lengths in output frames
    target_fps: float | None = 16.0  # None: keep the source fps; a slower source is never upsampled
    strategy: Literal["head", "uniform", "slide"] = "head"
    clips_per_video: int = 1  # K, for uniform
    clip_stride: int | None = None  # S in output frames, for slide; None: the clip length (no overlap)
    frame_step: int | None = None  # clip lengths are frame_step·k + 1 (the VAE's rule), named when a video is too short
    exact_fps: bool = False  # every clip at exactly target_fps: a slower source has no clip (rate_refusal says why)


@dataclass(frozen=True)
class Clip:
    """A training clip: a reference into its source video, not a copy."""

    start_frame: int  # first source frame
    num_frames: int  # output frames (the bucket's F)
    fps: float  # output frame rate
    frame_indices: tuple[int, ...]  # source frame of each output frame

    @property
    def end_frame(self) -> int:
        """One past the last source frame the clip reads."""
        return self.frame_indices[-1] + 1

    def to_json(self) -> dict[str, Any]:
        return {"start_frame": self.start_frame, "num_frames": self.num_frames, "fps": self.fps,
                "frame_indices": list(self.frame_indices)}


NTSC = 1001 / 1000  # 23.976, 29.97 and 59.94 fps are 24, 30 and 60 slowed by this ratio


def resample(src_fps: float, target_fps: float | None, exact: bool = False) -> tuple[float, float]:
    """``(output fps, source frames per output frame)``; sources slower than the target keep their fps.

    Upsampling would repeat frames and teach stutter, so a 12 fps source with target 16 stays at 12 fps
    (step 1) and its clips record ``fps: 12``. With ``exact`` (``bucket.exact_fps``) a source at most the NTSC
    ratio slower (23.976 for 24) is taken frame for frame and recorded at the target rate, so that every clip
    has one rate; a slower one is refused (:func:`rate_refusal`).
    """
    if exact and target_fps and src_fps < target_fps <= src_fps * NTSC + 1e-9:
        return float(target_fps), 1.0
    if not target_fps or target_fps >= src_fps:
        return float(src_fps), 1.0
    return float(target_fps), src_fps / target_fps


def rate_refusal(fps: float, policy: ClipPolicy) -> str | None:
    """Why a ``fps`` video has no clip under ``policy.exact_fps`` (it is slower than the target), else None."""
    if not policy.exact_fps or not policy.target_fps:
        return None
    out_fps, _ = resample(fps, policy.target_fps, exact=True)
    if out_fps == float(policy.target_fps):
        return None
    return (f"video at {fps:g} fps is slower than bucket.target_fps {policy.target_fps:g}, and bucket.exact_fps "
            f"gives every clip that one rate (clips are never upsampled); lower bucket.target_fps to {fps:g} or "
            "leave the video out")


def _offset(i: int, step: float) -> int:
    # round half up (Python's round() is half-to-even, which spaces frames unevenly); the epsilon keeps
    # 2.4999999 from float error on the right side of .5
    return math.floor(i * step + 0.5 + 1e-9)


def _span(n: int, step: float) -> int:
    """Source frames covered by an ``n``-frame clip."""
    return _offset(n - 1, step) + 1


def _starts(policy: ClipPolicy, lo: int, hi: int, span: int, n: int, step: float) -> list[int]:
    room = hi - lo - span  # how far the window can move inside [lo, hi)
    if policy.strategy == "head":
        return [lo]
    if policy.strategy == "uniform":
        k = policy.clips_per_video
        if k == 1:
            return [lo + room // 2]
        return [lo + (2 * i * room + k - 1) // (2 * (k - 1)) for i in range(k)]
    stride = policy.clip_stride or n
    starts, i = [], 0
    while (start := lo + _offset(i * stride, step)) <= lo + room:
        starts.append(start)
        i += 1
    return starts


def segments(frames: int, cuts: Iterable[int] = ()) -> list[tuple[int, int]]:
    """``[start, end)`` source-frame ranges between scene cuts (a cut is the first frame of a scene)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < frames}), frames]
    return list(zip(bounds, bounds[1:]))


def plan_clips(frames: int, fps: float, policy: ClipPolicy, cuts: Iterable[int] = ()) -> list[Clip]:
    """The clips of a ``frames``-long video at ``fps``, in order; empty when it is too short.

    Each scene (the whole video without cuts) is planned on its own, so no clip crosses a cut: its clip
    length is the largest admissible frame count that fits in it after resampling, and its windows are
    placed by the strategy: ``head`` one at the start; ``uniform`` K evenly spaced from start to end (one
    centred window for K=1; fewer when the scene has room for fewer distinct windows); ``slide`` from
    the start every S output frames while the window fits.
    """
    if rate_refusal(fps, policy):
        return []
    out_fps, step = resample(fps, policy.target_fps, policy.exact_fps)
    counts = sorted(policy.frame_counts)
    clips: list[Clip] = []
    for lo, hi in segments(frames, cuts):
        fitting = [n for n in counts if _span(n, step) <= hi - lo]
        if not fitting:
            continue
        n = fitting[-1]
        span = _span(n, step)
        seen = set()
        for start in _starts(policy, lo, hi, span, n, step):
            if start in seen:
                continue
            seen.add(start)
            indices = tuple(start + _offset(i, step) for i in range(n))
            clips.append(Clip(start, n, round(out_fps, 6), indices))
    return clips


def plan_clips_timed(times: Sequence[float], fps: float, policy: ClipPolicy, cuts: Iterable[int] = ()) -> list[Clip]:
    """:func:`plan_clips` for a variable-frame-rate video: output frames are evenly spaced in *time*.

    ``times`` are the frames' start times, ``fps`` the average rate. The clips are planned on a grid of
    the output rate over the video's duration (a grid frame every ``1 / output fps`` seconds), then each
    grid frame becomes the source frame on screen at its time, within the same scene: a frame held on
    screen for long repeats, as a player would show it.
    """
    times = list(times)
    if not times or rate_refusal(fps, policy):
        return []
    out_fps, _ = resample(fps, policy.target_fps, policy.exact_fps)
    t0 = times[0]
    grid = int(math.floor((times[-1] - t0) * out_fps + 1e-6)) + 1
    real_cuts = sorted({c for c in cuts if 0 < c < len(times)})
    grid_cuts = [math.ceil((times[c] - t0) * out_fps - 1e-6) for c in real_cuts]  # first grid frame of a scene
    scenes = segments(len(times), real_cuts)
    clips = []
    for clip in plan_clips(grid, out_fps, replace(policy, target_fps=None, exact_fps=False), grid_cuts):
        first = _shown_at(times, t0 + clip.frame_indices[0] / out_fps)
        lo, hi = next((a, b) for a, b in scenes if a <= first < b)
        indices = tuple(min(max(_shown_at(times, t0 + j / out_fps), lo), hi - 1) for j in clip.frame_indices)
        clips.append(Clip(indices[0], clip.num_frames, clip.fps, indices))
    return clips


def _shown_at(times: Sequence[float], t: float) -> int:
    """Index of the frame on screen at time ``t``: the last one starting at or before it (half a
    millisecond of tolerance for rounded timestamps)."""
    import bisect

    return max(0, bisect.bisect_right(times, t + 5e-4) - 1)


def output_frames(frames: int, fps: float, target_fps: float | None, exact: bool = False) -> int:
    """How many output frames ``frames`` source frames give after resampling."""
    _, step = resample(fps, target_fps, exact)
    n = max(0, math.ceil((frames - 0.5) / step))
    while n > 0 and _span(n, step) > frames:
        n -= 1
    return n


def too_short_reason(frames: int, fps: float, policy: ClipPolicy, cuts: Iterable[int] = ()) -> str:
    """Why :func:`plan_clips` found no clip: the video's rate (:func:`rate_refusal`), or its length, naming the
    smallest bucket."""
    refused = rate_refusal(fps, policy)
    if refused:
        return refused
    out_fps, _ = resample(fps, policy.target_fps, policy.exact_fps)
    longest = max(hi - lo for lo, hi in segments(frames, cuts))
    have = output_frames(longest, fps, policy.target_fps, policy.exact_fps)
    where = f"its longest scene has {longest} frames" if longest < frames else f"{frames} frames"
    rule = f"; clips are {policy.frame_step}k+1 frames, bucket.frame_step" if policy.frame_step else ""
    return (f"video too short: {where} at {fps:g} fps give {have} frames at {out_fps:g} fps; "
            f"the smallest bucket needs {min(policy.frame_counts)} frames (bucket.frame_counts{rule})")


def encode_clip(frames_FHWC: torch.Tensor, fps: float, keyframe_interval: int = 8, crf: int = 17) -> bytes:
    """H.264 in MP4 of ``uint8 [F, H, W, 3]`` frames, a keyframe every ``keyframe_interval`` frames.

    One encoder thread and fixed settings make the bytes a pure function of the frames (for a given
    FFmpeg build). Odd sizes are encoded as 4:4:4 (4:2:0 needs even sizes), so no pixel is cropped.
    """
    from fractions import Fraction

    import av

    _, height, width, _ = frames_FHWC.shape
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if width % 2 == 0 and height % 2 == 0 else "yuv444p"
        stream.options = {"threads": "1", "crf": str(crf), "g": str(keyframe_interval),
                          "keyint_min": str(keyframe_interval), "bframes": "0", "sc_threshold": "0"}
        for frame in frames_FHWC.contiguous().numpy():
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


CLIP_MEMBER = "mp4"


def read_clip(meta: dict[str, Any], sample: dict[str, Any] | None = None) -> torch.Tensor:
    """The frames of a bucketed clip sample as ``uint8 [F, H, W, 3]`` (what the cache stage encodes).

    A re-encoded clip (``meta["clip"]["reencoded"]``, ``bucket.reencode``) is read from the sample's
    ``mp4`` member, every frame of it; otherwise the clip's ``frame_indices`` are read from
    ``meta["source_uri"]``.
    """
    clip = meta["clip"]
    if clip.get("reencoded"):
        if sample is None or CLIP_MEMBER not in sample:
            raise ValueError(f"clip is re-encoded but the sample has no {CLIP_MEMBER} member")
        return read_frames(sample[CLIP_MEMBER], range(clip["num_frames"]), rotation=0)  # written upright
    return read_frames(meta["source_uri"], clip["frame_indices"], rotation=meta.get("rotation", 0))


# ---------------------------------------------------------------------------------------------------------
# Scene cuts
# ---------------------------------------------------------------------------------------------------------


def detect_cuts(uri: str | bytes, threshold: float = 27.0) -> list[int]:
    """First frame of every scene after the first (PySceneDetect ``ContentDetector``, decoded with PyAV).

    ``min_scene_len`` is 1: a suppressed cut would let a clip cross it, whereas an extra cut only makes
    a scene shorter.
    """
    import logging

    from scenedetect import ContentDetector, SceneManager
    from scenedetect.backends.pyav import VideoStreamAv

    log = logging.getLogger("pyscenedetect")
    if log.level <= logging.INFO:  # scenedetect sets INFO itself; its line per video would drown progress bars
        log.setLevel(logging.WARNING)
    src = _source(uri)
    video = VideoStreamAv(_open_arg(src), name="video")
    manager = SceneManager()
    manager.add_detector(ContentDetector(threshold=threshold, min_scene_len=1))
    manager.detect_scenes(video, show_progress=False)
    return sorted(int(start.frame_num) for start, _ in manager.get_scene_list()[1:])
