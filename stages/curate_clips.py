"""Per-clip video scores for the curate stage: K frames per clip, every clip of a video in one decode.

The bucket stage cuts a video into clips (:func:`latentmill.stages.video.plan_clips`, by frame time
:func:`~latentmill.stages.video.plan_clips_timed` for a variable-frame-rate video, never across a scene cut
with ``bucket.scene_split``). Curate runs before it and owns the thresholds, so when the prep hands it the
bucket stage's clip plan (:class:`ClipSpec`, from ``bucket.*``) it plans the same clips with the same
functions and scores each one on ``curate.frames`` (K) frames spread over the clip's own frames
(:func:`clip_score_indices`: the rule :func:`latentmill.stages.captioners.media.frame_indices` applies to
a clip window, applied to the clip's list of source frames). Every clip of a video is decoded in one
forward pass (:func:`latentmill.stages.video.read_clips`: one open, frames dropped as soon as no later
clip needs them), then scored by the model-free scorers and the model scorers (one batched call per
video). Scene cuts are detected once, here, and kept in the video's json (``scene_cuts`` with
``scene_threshold``) so the bucket stage reuses them.

A clip's score key is the scorer's fingerprint, the video's content hash and the K source frames the clip
is scored on: a clip window that did not change keeps its scores, and a threshold change computes nothing.
The verdicts travel in the video's json, ``clip_scores: [{start_frame, num_frames, scores[, failed]}]``; the
bucket stage matches its clips to them by ``(start_frame, num_frames)``, quarantines a failed clip as
``<video key>-c<j>`` and gives a kept clip its own ``scores``. A video whose every clip fails is
quarantined whole, here.

Near-duplicate embeddings stay per video: with them on, the video's K whole-video frames (those it was
embedded from before) join the same decode pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from latentmill.stages import curate_models, pixels
from latentmill.stages.curate_scores import THRESHOLDS, score_frames, score_key
from latentmill.stages.video import (
    Clip,
    ClipPolicy,
    detect_cuts,
    frame_times,
    plan_clips,
    plan_clips_timed,
    read_clips,
)
from PIL import Image

if TYPE_CHECKING:
    from latentmill.stages.curate import CurateConfig

CLIP_KIND = "clip"  # the kind of a clip's row in prep/scores.parquet


@dataclass(frozen=True)
class ClipSpec:
    """How the bucket stage cuts videos into clips: its clip policy and, with ``bucket.scene_split``, the
    scene detector's threshold (None: no scene split)."""

    policy: ClipPolicy
    scene_threshold: float | None = None

    def fingerprint(self) -> dict[str, Any]:
        """What decides a video's clips (in the fingerprint of curate units that hold videos)."""
        policy = dataclasses.asdict(self.policy)
        policy["frame_counts"] = list(policy["frame_counts"])
        if not policy["exact_fps"]:  # (off, curate's unit ids stay those of recipes before the key)
            del policy["exact_fps"]
        return {"policy": policy, "scene_threshold": self.scene_threshold}


def clip_spec(bucket_cfg: Any) -> ClipSpec:
    """The :class:`ClipSpec` of a ``BucketConfig`` (``bucket.*`` keys)."""
    return ClipSpec(bucket_cfg.clip_policy(), float(bucket_cfg.scene_threshold) if bucket_cfg.scene_split else None)


def clip_key(video_key: str, j: int) -> str:
    """The key of clip ``j`` of a video, as the bucket stage writes it."""
    return f"{video_key}-c{j}"


def clip_score_indices(clip: Clip | list[int] | tuple[int, ...], k: int) -> list[int]:
    """The ``k`` source frames a clip is scored on: ``k`` of its frames spread uniformly over it (the centre
    of each of ``k`` equal segments of the clip's frame list, as ``media.frame_indices`` spreads ``k``
    frames over a clip window; ``k`` larger than the clip repeats frames)."""
    from latentmill.stages.captioners.media import frame_indices

    frames = list(clip.frame_indices if isinstance(clip, Clip) else clip)
    return [frames[p] for p in frame_indices(len(frames), 0, None, k)]


def scene_cuts(meta: dict[str, Any], source: Any, spec: ClipSpec) -> list[int]:
    """The video's scene cuts at the spec's threshold: those in its json when detected at that threshold,
    else :func:`detect_cuts` (a PyAV pass over the video); none without scene split."""
    if spec.scene_threshold is None:
        return []
    if meta.get("scene_threshold") == spec.scene_threshold and "scene_cuts" in meta:
        return [int(c) for c in meta["scene_cuts"]]
    return detect_cuts(source, spec.scene_threshold)


def plan_video(meta: dict[str, Any], spec: ClipSpec, cuts: list[int], source: Any = None) -> list[Clip]:
    """The clips the bucket stage will cut from this video: the same functions, on the same header facts
    (``source``: the video's bytes or URI, default ``source_uri``; read only for a variable frame rate)."""
    if meta.get("vfr"):
        return plan_clips_timed(frame_times(meta["source_uri"] if source is None else source), meta["fps"],
                                spec.policy, cuts)
    return plan_clips(int(meta["frames"]), float(meta["fps"]), spec.policy, cuts)


@dataclass
class ClipScores:
    """One clip of a video on its way through :func:`score_video`."""

    clip: Clip
    indices: list[int]  # the K source frames it is scored on
    keys: dict[str, str] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    computed: bool = False


@dataclass
class VideoScores:
    """A video's clips with their scores (``clips`` empty: the video is too short for a clip, or
    ``error``: it could not be planned or decoded, and is quarantined by the curate stage)."""

    clips: list[ClipScores]
    cuts: list[int] | None = None  # detected scene cuts (None: no scene split)
    error: str | None = None
    small: list[Image.Image] | None = None  # the whole-video K frames at score_side, for its embedding

    @property
    def computed(self) -> bool:
        return any(c.computed for c in self.clips)


def score_video(cfg: "CurateConfig", sample: dict[str, Any], meta: dict[str, Any], spec: ClipSpec,
                prints: dict[str, dict[str, Any]], known: Callable[[str], float | None], caption: str | None,
                background: tuple[int, int, int] = pixels.WHITE, whole_frames: bool = False) -> VideoScores:
    """Plan the video's clips as the bucket stage will, look every clip's scores up by key with ``known``
    (score key -> stored value or None), and decode the clips with a score missing in one pass to compute them.

    ``whole_frames``: also decode, in the same pass, the K frames the video is embedded from (its
    near-duplicate embedding), returned as ``small``. A planning or decode error is returned as ``error``
    (the curate stage then quarantines the video with that error)."""
    from latentmill.stages.captioners.media import media_member

    names = list(prints)
    try:
        _, member = media_member(sample, meta)
        source = sample[member] if member else meta["source_uri"]
        cuts = scene_cuts(meta, source, spec)
        clips = plan_video(meta, spec, cuts, source)
    except Exception as err:  # PyAV / decord / scenedetect errors, a sample with nothing to look at
        return VideoScores([], error=f"{type(err).__name__}: {err}")
    result = VideoScores([], cuts if spec.scene_threshold is not None else None)
    for clip in clips:
        item = ClipScores(clip, clip_score_indices(clip, cfg.frames))
        window = {"sha256": meta.get("sha256"), "clip": {"scored_frames": item.indices}}
        item.keys = {name: score_key(prints[name], window, caption if name == "clip_score" else None)
                     for name in names}
        item.values = {name: v for name, k in item.keys.items() if (v := known(k)) is not None}
        item.computed = len(item.values) < len(item.keys)
        result.clips.append(item)
    todo = [c for c in result.clips if c.computed]
    if not todo and not whole_frames:
        return result
    reads = [c.indices for c in todo]
    if whole_frames and meta.get("frames"):
        from latentmill.stages.captioners.media import frame_indices

        window = meta.get("clip") or {}
        reads.append(frame_indices(int(meta["frames"]), int(window.get("start_frame") or 0),
                                   window.get("num_frames"), cfg.frames))
    if not reads:
        return result
    try:
        decoded = _decode(cfg, source, reads, meta)
    except Exception as err:  # decord / PyAV errors: a damaged stream
        return VideoScores([], error=f"{type(err).__name__}: {err}")
    if len(decoded) > len(todo):
        big = decoded.pop()
        result.small = big if cfg.decode_side() == cfg.score_side else _shrink(big, cfg.score_side)
    _score_clips(cfg, todo, decoded, caption)
    return result


def _shrink(frames: list[Image.Image], side: int) -> list[Image.Image]:
    from latentmill.stages.captioners.media import fit_within

    return [fit_within(f, side) for f in frames]


def _decode(cfg: "CurateConfig", source: Any, reads: list[list[int]], meta: dict[str, Any]) -> list[list[Image.Image]]:
    """The frames of each index list at ``cfg.decode_side()``, all from one forward pass over the video
    (:func:`read_clips`: one open; what it holds at once is about one list's full-size frames, each
    list shrunk as soon as it is decoded), exactly the pixels ``read_frames`` gives for each list."""
    from latentmill.stages.captioners.media import fit_within

    rotation = int(meta.get("rotation", 0)) if meta.get("frames") else None
    out = []
    for got in read_clips(source, reads, rotation=rotation):
        if isinstance(got, Exception):
            raise got
        out.append([fit_within(Image.fromarray(frame_HWC), cfg.decode_side()) for frame_HWC in got.numpy()])
    return out


def _score_clips(cfg: "CurateConfig", todo: list[ClipScores], frames: list[list[Image.Image]],
                 caption: str | None) -> None:
    """Compute the missing scores of each clip from its decoded frames: the model-free ones per clip, the
    model ones in one batched call for the video's clips (``curate.batch_size`` frames per forward)."""
    needs = []
    for item, clip_frames in zip(todo, frames):
        missing = [n for n in item.keys if n not in item.values]
        small = clip_frames if cfg.decode_side() == cfg.score_side else _shrink(clip_frames, cfg.score_side)
        item.values.update(score_frames(small, [n for n in missing if n not in curate_models.MODEL_SCORERS]))
        needs.append([n for n in missing if n in curate_models.MODEL_SCORERS])
    waiting = [i for i, n in enumerate(needs) if n]
    if waiting:
        found = curate_models.model_scores(cfg, [frames[i] for i in waiting], [caption or ""] * len(waiting),
                                           [needs[i] for i in waiting])
        for i, values in zip(waiting, found):
            todo[i].values.update(values)


def failures(scores: dict[str, float], thresholds: dict[str, float]) -> list[tuple[str, str, float]]:
    """``(threshold name, scorer, bound)`` of every threshold the scores fail, in ``THRESHOLDS`` order."""
    return [(name, scorer, bound) for name, bound in thresholds.items()
            for scorer, side in [THRESHOLDS[name]]
            if scorer in scores and (scores[scorer] < bound if side == "min" else scores[scorer] > bound)]


def failure_reason(failed: list[tuple[str, str, float]]) -> str:
    """The quarantine reason for these failures (constant per threshold, so reasons count up)."""
    return "; ".join(f"{scorer} beyond curate.{name}={bound:g}" for name, scorer, bound in failed)


ALL_CLIPS_FAIL = "every clip beyond a threshold: "  # + the union of the clips' reasons


def verdicts(video: VideoScores, names: list[str], thresholds: dict[str, float]
             ) -> tuple[list[dict[str, Any]], list[list[tuple[str, str, float]]]]:
    """The video's ``clip_scores`` entries (``start_frame``, ``num_frames``, ``scores`` rounded as curate
    rounds, and ``failed``, the reason, for a clip that fails a threshold) and each clip's failed thresholds."""
    entries, fails = [], []
    for item in video.clips:
        scores = {name: round(item.values[name], 6) for name in names if name in item.values}
        failed = failures(scores, thresholds)
        entry = {"start_frame": item.clip.start_frame, "num_frames": item.clip.num_frames, "scores": scores}
        if failed:  # absent for a kept clip (a sample's json has no null fields)
            entry["failed"] = failure_reason(failed)
        entries.append(entry)
        fails.append(failed)
    return entries, fails


def whole_video_reason(fails: list[list[tuple[str, str, float]]]) -> str:
    """The reason a video whose every clip fails is quarantined with: the thresholds its clips fail."""
    seen = {name: (name, scorer, bound) for failed in fails for name, scorer, bound in failed}
    return ALL_CLIPS_FAIL + failure_reason([seen[n] for n in THRESHOLDS if n in seen])
