"""Bucket: give every sample a target size (width, height, frames) and a crop; cut videos into clips.

A spatial bucket is the size whose aspect ratio is nearest the sample's (in log space) among the
configured ratios, scaled to a pixel budget (a *tier*, ``r × r`` pixels) and rounded to multiples of
``step``. Images and videos have their own tiers (defaults: 256/512/1024 for images, ≈480p/720p for
video). A sample goes to the tier nearest its own pixel count, or with ``no_upscale`` to the largest tier
whose bucket fits inside it (it is then never enlarged; a sample smaller than every bucket is
quarantined). The crop (``center``, or ``random`` with ``bucket.seed``) is recorded per sample.

A video becomes clips (:func:`latentmill.stages.video.plan_clips`; by frame time, :func:`latentmill.stages.video.plan_clips_timed`,
for a variable-frame-rate video): windows resampled to ``target_fps`` whose frame
count is an admissible one (``frame_step·k+1``), placed by ``clip_strategy``, never across a scene cut
when ``scene_split`` is on. A source slower than ``target_fps`` keeps its own rate, or with ``exact_fps`` is
quarantined, so that every clip has the one rate (LTX-2, whose batches hold each clip's sound). Clip ``j`` of video ``k`` is written as sample ``k-c<j>`` with
``meta["clip"] = {start_frame, num_frames, fps, frame_indices}`` and bucket ``[W, H, num_frames]``: a
reference into the source, decoded by the cache stage (:func:`latentmill.stages.video.read_clip`); with
``reencode`` the clip's frames are also stored as a short H.264 ``mp4`` member. A video with no clip is
quarantined with the reason. The unit record counts ``videos``, ``clips`` (planned) and ``expanded``
(clips beyond one per video), so ``in + expanded = out + quarantined``.

The curate stage scores videos per clip (:mod:`latentmill.stages.curate_clips`, same clip plan, same
planning functions) and leaves its verdicts in the video's json (``clip_scores``, and the ``scene_cuts`` it
detected at ``scene_threshold``, reused here): a clip whose entry ``failed`` a threshold is quarantined as
``k-c<j>`` with the reason and its scores (``clips_below_threshold`` in the record; it still counts as
planned), a kept clip gets its own ``scores`` and no ``clip_scores``.

The stage also applies the curate stage's near-duplicate decisions (``latentmill.stages.neardup``): its plan
gives each unit the decisions for the samples of its input shards (``payload["near_duplicates"]``), its
process quarantines those samples (``near duplicate``, ``duplicate_of``, ``cosine``). The threshold and the
embedder are in the fingerprint, so a changed threshold re-runs the units, which copy their samples.

The stage only decides sizes, crops and windows; pixels are decoded, resized and cropped once, in the
cache stage (scene detection, when on, is the one exception: it has to look at the frames). Each output
shard holds one bucket, so a batch drawn from a shard never mixes shapes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from latentmill.stages.neardup import REASON as NEAR_DUP_REASON
from latentmill.stages.neardup import decisions_for
from latentmill.stages.shardindex import ShardIndexError, load_shard_index
from latentmill.stages.shardio import (
    StageDir,
    UnitOutput,
    WorkUnit,
    check_shard_bytes,
    copy_estimate,
    iter_unit_samples,
    sample_json,
    shard_buckets,
    sibling_stage,
    unit_input_shards,
    units_by_bytes,
)
from latentmill.stages.tarshard import read_shard
from latentmill.stages.video import (
    CLIP_MEMBER,
    ClipPolicy,
    admissible_frame_counts,
    detect_cuts,
    encode_clip,
    frame_times,
    plan_clips,
    plan_clips_timed,
    read_frames,
    too_short_reason,
)

from latentmill.core.config import ConfigError
from latentmill.core.hashing import meta_bytes, stable_hash

STAGE = "bucket"
FORMAT_VERSION = 2  # 2: tiers, no_upscale, random crop, video clips
DEFAULT_ASPECT_RATIOS = [0.5, 0.5625, 0.6667, 0.75, 1.0, 1.3333, 1.5, 1.7778, 2.0]
IMAGE_TIERS = [256, 512, 1024]  # pixel budgets 256², 512², 1024²
VIDEO_TIERS = [640, 960]  # ≈ 480p (848×480 at 16:9) and 720p (1280×720 at 16:9)


@dataclass
class BucketConfig:
    """Pixel budgets, aspect ratios, size quantisation, crop, and how videos become clips."""

    resolution: Optional[int] = None  # one pixel budget resolution² for images and videos (overrides tiers)
    resolutions: Optional[list[int]] = None  # image tiers; default IMAGE_TIERS (or [resolution])
    video_resolutions: Optional[list[int]] = None  # video tiers; default resolutions, [resolution], VIDEO_TIERS
    aspect_ratios: list[float] = field(default_factory=lambda: list(DEFAULT_ASPECT_RATIOS))
    step: int = 16  # sizes are multiples of this (8× VAE × 2×2 patches)
    no_upscale: bool = False  # never enlarge: the largest bucket that fits inside the sample
    crop: Literal["center", "random"] = "center"
    seed: int = 0  # random crops are a pure function of (seed, sample key)
    # video
    frame_counts: Optional[list[int]] = None  # admissible clip lengths; default frame_step·k+1 up to max_frames
    frame_step: int = 4  # temporal compression of the video VAE: clip lengths are frame_step·k + 1
    max_frames: int = 81
    target_fps: Optional[float] = 16.0  # null: keep each video's fps (a slower video is never upsampled)
    # every clip at exactly target_fps (a source slower than it is quarantined; 23.976 counts as 24): the
    # families whose batch needs one rate (LTX-2: a clip's sound is as long as the clip lasts)
    exact_fps: bool = False
    clip_strategy: Literal["head", "uniform", "slide"] = "head"
    clips_per_video: int = 1  # K windows for uniform
    clip_stride: Optional[int] = None  # S output frames between slide windows; null: the clip length
    scene_split: bool = False  # detect hard cuts (PySceneDetect) so no clip spans one
    scene_threshold: float = 27.0  # ContentDetector threshold
    reencode: bool = False  # store each clip as its own short H.264 member instead of a reference
    reencode_keyframe_interval: int = 8  # frames between keyframes of a re-encoded clip (1: all-intra)
    reencode_crf: int = 17  # x264 quality of a re-encoded clip (lower is better, 0 lossless)
    # target size of a bucket shard: upstream shards are grouped into units up to this many bytes
    shard_bytes: int = 256 << 20

    def validate(self) -> None:
        check_shard_bytes(self.shard_bytes, "bucket.shard_bytes")

        if self.step < 1 or self.step % 16:
            raise ConfigError(f"bucket.step: must be a positive multiple of 16, got {self.step}")
        if self.resolution is not None and self.resolution < self.step:
            raise ConfigError(f"bucket.resolution: must be >= bucket.step ({self.step}), got {self.resolution}")
        for key in ("resolutions", "video_resolutions"):
            tiers = getattr(self, key)
            if tiers is not None and (not tiers or min(tiers) < self.step):
                raise ConfigError(f"bucket.{key}: needs at least one pixel budget, each >= bucket.step "
                                  f"({self.step}), got {tiers}")
        if not self.aspect_ratios or any(a <= 0 for a in self.aspect_ratios):
            raise ConfigError("bucket.aspect_ratios: needs at least one positive width/height ratio")
        if self.frame_step < 1:
            raise ConfigError(f"bucket.frame_step: must be >= 1, got {self.frame_step}")
        if self.max_frames < 1:
            raise ConfigError(f"bucket.max_frames: must be >= 1, got {self.max_frames}")
        if self.frame_counts is not None:
            allowed = admissible_frame_counts(self.frame_step, min(self.max_frames, 8 * self.frame_step + 1),
                                              include_one=True)
            for n in self.frame_counts:
                if n < 1 or (n - 1) % self.frame_step:
                    raise ConfigError(f"bucket.frame_counts: {n} is not frame_step·k+1 (bucket.frame_step="
                                      f"{self.frame_step}); allowed: {', '.join(map(str, allowed))}, ...")
            if not any(n <= self.max_frames for n in self.frame_counts):
                raise ConfigError(f"bucket.frame_counts: none is <= bucket.max_frames ({self.max_frames})")
        elif self.max_frames <= self.frame_step:
            raise ConfigError(f"bucket.max_frames: must be > bucket.frame_step ({self.frame_step}) when "
                              "bucket.frame_counts is not set")
        if self.target_fps is not None and self.target_fps <= 0:
            raise ConfigError(f"bucket.target_fps: must be > 0 or null, got {self.target_fps}")
        if self.exact_fps and self.target_fps is None:
            raise ConfigError("bucket.exact_fps: true needs bucket.target_fps, the one rate of every clip "
                              "(e.g. bucket.target_fps: 24)")
        if self.clips_per_video < 1:
            raise ConfigError(f"bucket.clips_per_video: must be >= 1, got {self.clips_per_video}")
        if self.clip_stride is not None and self.clip_stride < 1:
            raise ConfigError(f"bucket.clip_stride: must be >= 1 or null, got {self.clip_stride}")
        if self.reencode_keyframe_interval < 1:
            raise ConfigError(f"bucket.reencode_keyframe_interval: must be >= 1, got {self.reencode_keyframe_interval}")
        if not 0 <= self.reencode_crf <= 51:
            raise ConfigError(f"bucket.reencode_crf: must be in 0..51, got {self.reencode_crf}")
        if self.scene_threshold <= 0:
            raise ConfigError(f"bucket.scene_threshold: must be > 0, got {self.scene_threshold}")
        if self.scene_split:
            import importlib.util

            if importlib.util.find_spec("scenedetect") is None:
                raise ConfigError("bucket.scene_split: true needs the scenedetect package "
                                  "(pip install scenedetect); allowed without it: false")

    def tiers(self, kind: str = "image") -> list[int]:
        """The pixel budgets (sides of the square budget) for ``kind`` (``image`` | ``video``)."""
        single = [self.resolution] if self.resolution else None
        if kind == "video":
            return sorted(set(self.video_resolutions or self.resolutions or single or VIDEO_TIERS))
        return sorted(set(self.resolutions or single or IMAGE_TIERS))

    def frame_count_list(self) -> list[int]:
        """The admissible clip lengths, ascending, at most ``max_frames``."""
        if self.frame_counts is None:
            return admissible_frame_counts(self.frame_step, self.max_frames)
        return sorted({n for n in self.frame_counts if n <= self.max_frames})

    def clip_policy(self) -> ClipPolicy:
        return ClipPolicy(tuple(self.frame_count_list()), self.target_fps, self.clip_strategy,
                          self.clips_per_video, self.clip_stride, self.frame_step, self.exact_fps)


def bucket_sizes(cfg: BucketConfig, resolution: int | None = None) -> dict[float, tuple[int, int]]:
    """Map every aspect ratio to its (width, height) at the pixel budget, multiples of ``step``.

    ``resolution`` defaults to the largest image tier.
    """
    side = resolution or cfg.tiers("image")[-1]
    budget = side * side
    sizes = {}
    for ratio in sorted(set(cfg.aspect_ratios)):
        width = max(cfg.step, round(math.sqrt(budget * ratio) / cfg.step) * cfg.step)
        height = max(cfg.step, round(math.sqrt(budget / ratio) / cfg.step) * cfg.step)
        sizes[ratio] = (width, height)
    return sizes


def admitted_buckets(cfg: BucketConfig, video: bool) -> list[tuple[int, int, int]]:
    """Every bucket ``(W, H, F)`` this config can give a sample, sorted: images at the image tiers (``F`` = 1)
    and, for a video family (``video``), clips of every admissible length at the video tiers."""
    kinds = [("image", [1])] + ([("video", cfg.frame_count_list())] if video else [])
    return sorted({(w, h, f) for kind, frames in kinds for tier in cfg.tiers(kind)
                   for w, h in bucket_sizes(cfg, tier).values() for f in frames})


def nearest_ratio(width: int, height: int, cfg: BucketConfig) -> float:
    """The configured aspect ratio nearest ``width / height`` in log space (ties: the smaller ratio)."""
    aspect = math.log(width / height)
    return min(sorted(set(cfg.aspect_ratios)), key=lambda r: (abs(math.log(r) - aspect), r))


class TooSmall(ValueError):
    """With ``no_upscale``, a sample smaller than every bucket of its aspect ratio."""


def bucket_for(width: int, height: int, cfg: BucketConfig, frames: int = 1,
               kind: str | None = None) -> tuple[int, int, int]:
    """The (width, height, frames) bucket of a ``width``×``height`` sample.

    ``kind`` (``image`` | ``video``; default: ``video`` when ``frames > 1``) picks the tiers. Raises
    :class:`TooSmall` under ``no_upscale`` when no bucket fits inside the sample.
    """
    kind = kind or ("video" if frames > 1 else "image")
    ratio = nearest_ratio(width, height, cfg)
    sizes = [(tier, bucket_sizes(cfg, tier)[ratio]) for tier in cfg.tiers(kind)]
    if cfg.no_upscale:
        fitting = [size for _, size in sizes if size[0] <= width and size[1] <= height]
        if not fitting:
            smallest = sizes[0][1]
            raise TooSmall(f"{width}x{height} is smaller than the smallest {kind} bucket "
                           f"{smallest[0]}x{smallest[1]} of its aspect ratio (bucket.no_upscale)")
        bw, bh = max(fitting, key=lambda s: s[0] * s[1])
    else:
        pixels = math.log(width * height)
        _, (bw, bh) = min(sizes, key=lambda ts: (abs(2 * math.log(ts[0]) - pixels), ts[0]))
    return bw, bh, frames


def crop_for(width: int, height: int, bucket: tuple[int, int, int] | list[int], policy: str = "center",
             seed: int = 0, key: str = "") -> dict[str, Any]:
    """Resize-to-cover then crop parameters that turn ``width``×``height`` into the bucket size.

    ``center`` centres the crop; ``random`` draws its offset from a generator seeded by ``(seed, key)``,
    so the same sample gets the same crop on every run with the same seed.
    """
    bw, bh = bucket[0], bucket[1]
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    if policy == "random":
        rng = random.Random(int(stable_hash([seed, key])[:16], 16))
        left, top = rng.randint(0, rw - bw), rng.randint(0, rh - bh)
        return {"resize_width": rw, "resize_height": rh, "left": left, "top": top}
    return {"resize_width": rw, "resize_height": rh, "left": (rw - bw) // 2, "top": (rh - bh) // 2}


def fingerprint(cfg: BucketConfig, near_dups: dict[str, Any] | None = None) -> dict[str, Any]:
    """The unit fingerprint; ``near_dups`` (:func:`near_dup_spec`): the near-duplicate decisions applied."""
    fp: dict[str, Any] = {
        "stage": STAGE, "version": FORMAT_VERSION,
        "sizes": {kind: [sorted(bucket_sizes(cfg, t).values()) for t in cfg.tiers(kind)]
                  for kind in ("image", "video")},
        "no_upscale": cfg.no_upscale, "crop": cfg.crop,
        "clips": {"frame_counts": cfg.frame_count_list(), "target_fps": cfg.target_fps,
                  "strategy": cfg.clip_strategy, "scene_split": cfg.scene_split},
    }
    if cfg.crop == "random":
        fp["seed"] = cfg.seed
    if cfg.clip_strategy == "uniform":
        fp["clips"]["clips_per_video"] = cfg.clips_per_video
    if cfg.clip_strategy == "slide":
        fp["clips"]["clip_stride"] = cfg.clip_stride
    if cfg.scene_split:
        fp["clips"]["scene_threshold"] = cfg.scene_threshold
    if cfg.exact_fps:  # (off, the fingerprint and so the unit ids stay those of recipes before the key)
        fp["clips"]["exact_fps"] = True
    if cfg.reencode:
        fp["reencode"] = {"keyframe_interval": cfg.reencode_keyframe_interval, "crf": cfg.reencode_crf}
    if near_dups is not None:
        fp["near_duplicates"] = {"embedder": stable_hash(near_dups["embedder"]),
                                 "threshold": near_dups["threshold"]}
    return fp


def near_dup_spec(embedder: dict[str, Any] | None, threshold: float | None) -> dict[str, Any] | None:
    """Which near-duplicate decisions the bucket stage applies: the curate embedder's fingerprint and
    ``curate.dedup_threshold``; None when near-duplicate removal is off."""
    if embedder is None or threshold is None:
        return None
    return {"embedder": embedder, "threshold": float(threshold)}


def _unit_keys(entries: dict[str, dict[str, Any]], unit: WorkUnit) -> list[str]:
    """The sample keys of a unit's input shards (``entries``: upstream manifest entries by sha256), from their
    shard indexes (no sample is read)."""
    keys = []
    for sha, path in zip(unit.inputs, unit_input_shards(unit)):
        try:
            index = load_shard_index(path, entries.get(sha, {}).get("index"))
            keys += [index.key(i) for i in range(index.num_samples)]
        except ShardIndexError:
            keys += [s["__key__"] for s in read_shard(path)]
    return keys


def plan(cfg: BucketConfig, upstream: StageDir, stage_dir: StageDir | None = None,
         near_dups: dict[str, Any] | None = None) -> list[WorkUnit]:
    """Units of upstream shards grouped up to ``shard_bytes`` (their tar sizes); each unit writes one shard
    holding every bucket it meets (one per kind: images, video clips), each sample's bucket in its ``json``
    and in the shard index. ``stage_dir`` (by default the bucket folder beside ``upstream``) keeps the last
    run's groups. With ``near_dups`` each unit not committed yet gets the near-duplicate decisions of its
    samples (``payload["near_duplicates"]``: key -> [owner key, cosine]) from the curate folder's index."""
    stage_dir = stage_dir if stage_dir is not None else sibling_stage(upstream, STAGE)
    units = units_by_bytes(upstream, fingerprint(cfg, near_dups), cfg.shard_bytes, stage_dir, copy_estimate(512))
    if near_dups is not None:
        entries = {e["sha256"]: e for e in upstream.read_manifest()["shards"]}
        for unit in units:
            if not stage_dir.unit_path(unit.unit_id).is_file():
                found = decisions_for(upstream.root, near_dups["embedder"], near_dups["threshold"],
                                      _unit_keys(entries, unit))
                unit.payload["near_duplicates"] = {k: list(v) for k, v in sorted(found.items())}
    return units


def _crop(cfg: BucketConfig, meta: dict[str, Any], bucket: tuple[int, int, int], key: str) -> dict[str, Any]:
    crop = {"policy": cfg.crop, **crop_for(meta["width"], meta["height"], bucket, cfg.crop, cfg.seed, key)}
    if cfg.crop == "random":
        crop["seed"] = cfg.seed
    return crop


def _video_clips(cfg: BucketConfig, sample: dict[str, Any], meta: dict[str, Any], out: UnitOutput) -> int:
    """Write the clips of one video; return how many were planned (0: the video is quarantined).

    With ``reencode`` a clip whose frames cannot be decoded is quarantined on its own (key ``k-c<j>``),
    so every planned clip still ends in exactly one place.
    """
    key, source = sample["__key__"], meta.get("source", "?")
    policy = cfg.clip_policy()
    cuts: list[int] = []
    if cfg.scene_split and meta.get("scene_threshold") == cfg.scene_threshold and "scene_cuts" in meta:
        cuts = [int(c) for c in meta["scene_cuts"]]  # detected by the curate stage, at this threshold
    elif cfg.scene_split:
        try:
            cuts = detect_cuts(meta["source_uri"], cfg.scene_threshold)
        except Exception as err:  # PyAV / scenedetect errors: the video cannot be read
            out.quarantine(key, source, f"cannot read video for scene detection: {type(err).__name__}: {err}")
            return 0
    if meta.get("vfr"):
        try:
            clips = plan_clips_timed(frame_times(meta["source_uri"]), meta["fps"], policy, cuts)
        except Exception as err:  # decord / PyAV errors: the video cannot be read
            out.quarantine(key, source, f"cannot read frame times: {type(err).__name__}: {err}")
            return 0
    else:
        clips = plan_clips(meta["frames"], meta["fps"], policy, cuts)
    if not clips:
        out.quarantine(key, source, too_short_reason(meta["frames"], meta["fps"], policy, cuts))
        return 0
    try:
        width, height, _ = bucket_for(meta["width"], meta["height"], cfg, kind="video")
    except TooSmall as err:
        out.quarantine(key, source, str(err))
        return 0
    members = {k: v for k, v in sample.items() if k not in ("__key__", "json")}
    # the curate stage's per-clip verdicts, by (start_frame, num_frames); not carried into the clips' json
    verdicts = {(int(v["start_frame"]), int(v["num_frames"])): v for v in meta.pop("clip_scores", None) or ()}
    for j, clip in enumerate(clips):
        clip_key = f"{key}-c{j}"
        verdict = verdicts.get((clip.start_frame, clip.num_frames))
        if verdict is not None and verdict.get("failed"):
            out.quarantine(clip_key, source, verdict["failed"], scores=verdict["scores"], video_key=key,
                           clip={"start_frame": clip.start_frame, "num_frames": clip.num_frames})
            out.extra["clips_below_threshold"] = out.extra.get("clips_below_threshold", 0) + 1
            continue
        bucket = (width, height, clip.num_frames)
        clip_meta = {**meta, "key": clip_key, "video_key": key, "clip_index": j, "clip": clip.to_json(),
                     "bucket": list(bucket), "crop": _crop(cfg, meta, bucket, clip_key)}
        if verdict is not None:
            clip_meta["scores"] = verdict["scores"]
        if cfg.scene_split:
            clip_meta["scene_cuts"] = cuts
        clip_members = dict(members)
        if cfg.reencode:
            try:
                frames_FHWC = read_frames(meta["source_uri"], clip.frame_indices, rotation=meta.get("rotation", 0))
            except Exception as err:  # decord / PyAV errors: a damaged stream
                out.quarantine(clip_key, source, f"cannot decode clip frames: {type(err).__name__}: {err}")
                continue
            clip_members[CLIP_MEMBER] = encode_clip(frames_FHWC, clip.fps, cfg.reencode_keyframe_interval,
                                                    cfg.reencode_crf)
            clip_meta["clip"]["reencoded"] = {"member": CLIP_MEMBER, "codec": "h264",
                                              "keyframe_interval": cfg.reencode_keyframe_interval,
                                              "crf": cfg.reencode_crf}
        out.add({"__key__": clip_key, **clip_members, "json": meta_bytes(clip_meta)}, part="video",
                bucket=list(bucket))
    return len(clips)


def process(cfg: BucketConfig, unit: WorkUnit, out: UnitOutput) -> None:
    """Assign each sample its bucket and crop (each video its clips), writing it to that bucket's shard."""
    videos = clips = expanded = near = 0
    near_dups: dict[str, list[Any]] = unit.payload.get("near_duplicates") or {}
    for sample in iter_unit_samples(unit):
        meta = sample_json(sample)
        if sample["__key__"] in near_dups:  # a video is dropped whole, before it is cut into clips
            owner, cosine = near_dups[sample["__key__"]]
            near += 1
            out.quarantine(sample["__key__"], meta.get("source", "?"), NEAR_DUP_REASON, duplicate_of=owner,
                           cosine=cosine)
            continue
        if meta.get("kind") == "video":
            videos += 1
            n = _video_clips(cfg, sample, meta, out)
            clips += n
            expanded += max(0, n - 1)
            continue
        try:
            bucket = bucket_for(meta["width"], meta["height"], cfg, kind="image")
        except TooSmall as err:
            out.quarantine(sample["__key__"], meta.get("source", "?"), str(err))
            continue
        meta["bucket"] = list(bucket)
        meta["crop"] = _crop(cfg, meta, bucket, sample["__key__"])
        if isinstance(meta.get("reference"), dict):  # an edit pair: its source image fills the same bucket
            meta["reference"]["crop"] = _crop(cfg, meta["reference"], bucket, sample["__key__"])
        out.add({**sample, "json": meta_bytes(meta)}, part="image", bucket=list(bucket))
    out.extra.update(videos=videos, clips=clips, expanded=expanded)  # clips_below_threshold: _video_clips
    if near_dups:
        out.extra["near_duplicates"] = near


def histogram(manifest: dict[str, Any]) -> dict[str, int]:
    """Samples per bucket (``"WxHxF"``) in a bucket or cache manifest."""
    counts: dict[str, int] = {}
    for shard in manifest["shards"]:
        for key, n in shard_buckets(shard).items():
            counts[key] = counts.get(key, 0) + n
    return dict(sorted(counts.items()))
