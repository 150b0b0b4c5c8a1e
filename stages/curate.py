"""Curate: score every captioned sample, drop exact duplicates and samples below the recipe's thresholds.

The stage sits between caption and bucket (``docs/cache-format.md``, "Curation"). Per sample it

* drops an **exact duplicate** (same content ``sha256`` as a sample seen before) as ``duplicate_of: <key>``.
  The rule: the first sample seen with that content is kept; a sample of an earlier run always came first,
  and within a run upstream shards count in manifest order, samples in shard order. The index of content
  hashes (``prep/curate/dedup.sqlite``) grows with the data: a refresh reads the samples of its new
  upstream shards only, never the old data (:class:`DedupIndex`);
* computes its **scores** (model-free, on by default): ``sharpness``, the variance of the Laplacian of the
  grey image shrunk to ``curate.score_side``; ``exposure``, the share of its pixels at 0 or 255. An image
  with transparency is scored on its opaque pixels (alpha at least ``OPAQUE_ALPHA``): a cutout is not
  blown out by the background it is composited over (its score keys say so, ``opaque``). A video is
  scored on ``curate.frames`` frames spread over it, through the frame reader captioners use
  (:func:`latentmill.stages.captioners.media.load_media`, one decode): the mean over the frames. When
  listed or thresholded, also ``aesthetic`` and ``clip_score`` (CLIP / SigLIP models, batched over the
  unit's samples) and, for videos, ``motion`` (:mod:`latentmill.stages.curate_models`). Given the bucket
  stage's clip plan (``clips``, as the prep passes it), a video is scored per clip instead: K frames per
  clip, every clip in one decode, thresholds per clip (:mod:`latentmill.stages.curate_clips`);
* writes the scores into the sample's json (``scores: {name: value}``), then applies the thresholds
  (``curate.min_sharpness``, ``curate.max_exposure``, ``curate.min_aesthetic``, ...): a sample beyond one
  is quarantined with the reason (constant per threshold, so reasons count up in summaries) and its
  ``scores``. A sample that cannot be decoded is quarantined here with its decode error (``cannot decode
  pixels: ...``): curate is the first stage that decodes pixels (ingest reads headers), so bucket and
  cache never see it;
* with ``curate.dedup_threshold`` set, embeds every kept sample for near-duplicate removal (from the same
  decoded frames; an embedding is a component with its own key, stored per unit beside its shards): the
  index and the decisions are :mod:`latentmill.stages.neardup`'s, applied by the bucket stage.

Scores are components with keys of their own, like the cache's VAE and text components: key = hash of the
scorer's fingerprint and the sample's content hash (and clip window, when a sample has one). Every unit
lists its samples' score keys and values (``scores`` in its detail file, ``StageDir.unit_detail``), and a
unit that runs looks its scores up in all earlier units of the stage (the catalog) before it decodes
anything. The thresholds are
in the unit fingerprint (a changed threshold re-runs the stage's units, which copy their samples), never in
a score key or in a written sample: changing only a threshold computes no score, and a kept sample is
written with the same bytes, so the cache downstream copies its components without encoding them.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, NamedTuple, Optional

from latentmill.stages import curate_models, neardup, pixels
from latentmill.stages.catalog import Lookup
from latentmill.stages.curate_clips import ClipSpec
from latentmill.stages.curate_scores import THRESHOLDS, ScoreKeyer, opaque_mask, score_frames
from latentmill.stages.remotetars import read_ranges
from latentmill.stages.shardindex import ShardIndexError, load_shard_index
from latentmill.stages.shardio import (
    StageDir,
    UnitOutput,
    UnitRecord,
    WorkUnit,
    by_unit_id,
    check_shard_bytes,
    copy_estimate,
    grouped_unit_id,
    iter_unit_samples,
    sample_json,
    sibling_stage,
    units_by_bytes,
)
from latentmill.stages.tarshard import read_shard
from PIL import Image

from latentmill.core.config import ConfigError
from latentmill.core.hashing import meta_bytes, stable_hash

STAGE = "curate"
# 2: a sample that cannot be decoded is quarantined here (1 passed it on unscored); 3: an image with
# transparency is scored on its opaque pixels
FORMAT_VERSION = 3
SCORERS = ("sharpness", "exposure", "aesthetic", "clip_score", "motion")
DEFAULT_SCORERS = ("sharpness", "exposure")  # model-free, on by default; others when listed or thresholded
MODEL_SCORERS = curate_models.MODEL_SCORERS  # need a model (stages/curate_models.py)
SCORER_VERSION = 1  # in every score key: what decides a score's value
DEDUP_FILE = "dedup.sqlite"


@dataclass
class CurateConfig:
    """Which scores are computed and which thresholds drop samples (exact duplicates are always dropped)."""

    scorers: list[str] = field(default_factory=lambda: list(DEFAULT_SCORERS))  # a threshold adds its scorer
    min_sharpness: Optional[float] = None  # variance of the Laplacian (0..255 grey levels) below: quarantined
    max_exposure: Optional[float] = None  # share of clipped pixels (0 or 255) above: quarantined
    min_aesthetic: Optional[float] = None  # LAION-head score below: quarantined (~1..10 with the real head)
    min_clip_score: Optional[float] = None  # 100 x cosine(image, caption) below: quarantined
    min_motion: Optional[float] = None  # mean |frame difference| (grey levels) below / above: quarantined;
    max_motion: Optional[float] = None  # videos only (an image has no motion score)
    aesthetic_model: Optional[str] = None  # CLIP / SigLIP id or folder (e.g. openai/clip-vit-large-patch14)
    aesthetic_head: Optional[str] = None  # the MLP head, a safetensors file (LAION v2 layout)
    clip_model: Optional[str] = None  # the clip_score model; null: aesthetic_model
    score_side: int = 256  # images and frames are shrunk to this longer side before scoring
    model_side: int = 448  # with a model scorer on, frames are decoded at this longer side for the model
    frames: int = 4  # K frames per clip of a video (the bucket stage's clips), spread uniformly over it
    batch_size: int = 16  # samples decoded, then scored, at a time; images or captions per model forward
    device: Literal["auto", "cpu", "cuda"] = "auto"  # scorer models: auto = cuda when a GPU is visible
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # target size of a curate shard: upstream shards are grouped into units up to this many bytes
    shard_bytes: int = 256 << 20
    # --- near duplicates (stages/neardup.py) ---
    # cosine of two embeddings at or above which the later sample is a near duplicate; null: off (the default:
    # a 16x16 thumbnail over-merges flat and low-detail pictures; neardup.DEFAULT_THRESHOLD 0.92 is measured)
    dedup_threshold: Optional[float] = None
    dedup_index: str = "auto"  # nearest-neighbour search: auto (exact, then lsh) | lsh | exact | usearch

    def validate(self) -> None:
        check_shard_bytes(self.shard_bytes, "curate.shard_bytes")
        unknown = [s for s in self.scorers if s not in SCORERS]
        if unknown:
            raise ConfigError(f"curate.scorers: unknown scorer(s) {unknown}; allowed: {', '.join(SCORERS)}")
        if self.score_side < 8:
            raise ConfigError(f"curate.score_side: must be >= 8, got {self.score_side}")
        if self.frames < 1:
            raise ConfigError(f"curate.frames: must be >= 1, got {self.frames}")
        if self.min_sharpness is not None and self.min_sharpness < 0:
            raise ConfigError(f"curate.min_sharpness: must be >= 0 or null, got {self.min_sharpness}")
        if self.max_exposure is not None and not 0 <= self.max_exposure <= 1:
            raise ConfigError(f"curate.max_exposure: a share of pixels in 0..1 or null, got {self.max_exposure}")
        for name in ("min_motion", "max_motion"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"curate.{name}: grey levels >= 0 or null, got {getattr(self, name)}")
        if self.min_clip_score is not None and not -100 <= self.min_clip_score <= 100:
            raise ConfigError(f"curate.min_clip_score: 100 x a cosine, in -100..100 or null, "
                              f"got {self.min_clip_score}")
        if self.model_side < 8:
            raise ConfigError(f"curate.model_side: must be >= 8, got {self.model_side}")
        if self.batch_size < 1:
            raise ConfigError(f"curate.batch_size: must be >= 1, got {self.batch_size}")
        curate_models.check_config(self, self.active_scorers())
        if self.dedup_threshold is not None and not 0 < self.dedup_threshold <= 1:
            raise ConfigError(f"curate.dedup_threshold: a cosine in (0, 1] or null (off), got {self.dedup_threshold}")
        if self.dedup_index not in neardup.INDEX_KINDS:
            raise ConfigError(f"curate.dedup_index: unknown search {self.dedup_index!r}; allowed: "
                              f"{', '.join(neardup.INDEX_KINDS)}")
        if self.dedup_index == "usearch" and not neardup.usearch_available():
            raise ConfigError("curate.dedup_index: usearch needs the usearch package (pip install "
                              "'latentmill[dedup]'); allowed without it: auto, lsh, exact")

    def thresholds(self) -> dict[str, float]:
        """The thresholds that are set: ``{"min_sharpness": 50.0, ...}``."""
        return {name: float(getattr(self, name)) for name in THRESHOLDS if getattr(self, name) is not None}

    def embedder_fingerprint(self, background: tuple[int, int, int] = pixels.WHITE) -> dict[str, Any] | None:
        """The near-duplicate embedder's fingerprint, or None when near-duplicate removal is off."""
        if self.dedup_threshold is None:
            return None
        fp = neardup.embedder_fingerprint(self.frames, self.score_side, background)
        if self.embeds_with_model():  # the aesthetic model's image embedding, not the pixel thumbnail
            from latentmill.stages.captioners.hf import model_fingerprint

            fp = {**fp, "embedder": "image-model", "side": None, "version": 1,
                  "model": model_fingerprint(str(self.aesthetic_model)), "dtype": self.dtype}
        return fp

    def embeds_with_model(self) -> bool:
        """Near duplicates are searched with the aesthetic model's image embeddings when that scorer is on
        (the issue's rule: the same model as ``aesthetic``), else with the model-free pixel thumbnail."""
        return self.dedup_threshold is not None and "aesthetic" in self.active_scorers()

    def active_scorers(self) -> list[str]:
        """The scorers that run: those listed in ``curate.scorers`` plus those a threshold needs, in
        ``SCORERS`` order."""
        wanted = set(self.scorers) | {THRESHOLDS[name][0] for name in self.thresholds()}
        return [s for s in SCORERS if s in wanted]

    def decode_side(self) -> int:
        """The longer side frames are decoded at: ``score_side``, or ``model_side`` when larger and a model
        scorer is on (so that a CLIP input of 224 is not upsampled from a 256 x 144 frame)."""
        if any(s in MODEL_SCORERS for s in self.active_scorers()):
            return max(self.score_side, self.model_side)
        return self.score_side


# ---------------------------------------------------------------------------------------------------------
# Scorer fingerprints
# ---------------------------------------------------------------------------------------------------------


def scorer_fingerprint(cfg: CurateConfig, name: str, background: tuple[int, int, int]) -> dict[str, Any]:
    """What decides one scorer's value for a given sample content: the scorer and how pixels reach it (and,
    for a model scorer, the model's and head's weights: a different model means new score keys)."""
    fp: dict[str, Any] = {"scorer": name, "version": SCORER_VERSION, "side": cfg.score_side,
                          "frames": cfg.frames, "background": list(background)}
    if cfg.decode_side() != cfg.score_side:  # absent otherwise: the keys of model-free runs stay as they were
        fp["decode_side"] = cfg.decode_side()
    if name in MODEL_SCORERS:
        del fp["side"]  # the model sees frames at decode_side, resized by its own processor
        fp["decode_side"] = cfg.decode_side()
        fp.update(curate_models.fingerprint(cfg, name))
    return fp


def caption_text(sample: dict[str, Any], meta: dict[str, Any]) -> str:
    """The sample's primary caption (its ``.txt`` member, else ``caption`` in its json; empty if none)."""
    if sample.get("txt"):
        return bytes(sample["txt"]).decode("utf-8", errors="replace")
    return str(meta.get("caption") or "")


class Decoded(NamedTuple):
    """A sample decoded for scoring: its kind, its frames (an image: one), and per frame the alpha of an image
    ingest found transparency in (``alphas``; None otherwise)."""

    kind: str
    frames: list[Image.Image]
    alphas: list[Image.Image | None] | None = None


def decode_and_score(sample: dict[str, Any], meta: dict[str, Any], cfg: CurateConfig, names: list[str],
                     background: tuple[int, int, int] = pixels.WHITE,
                     decoded: Decoded | None = None
                     ) -> tuple[str, dict[str, float], list[Image.Image]]:
    """``(kind, model-free scores, frames)``: decode a sample as the captioners do (an image, or
    ``cfg.frames`` frames spread over a video or its clip window, through ``video.read_frames``) at
    ``cfg.decode_side()``, score the named model-free scorers on the frames shrunk to ``cfg.score_side``
    (``motion`` only for a video), and return the decoded frames for the model scorers. Raises the
    decoder's error for a sample that cannot be decoded. ``decoded``: :func:`decode_media`'s result for
    the sample, when it was decoded already. An image with transparency is scored on its opaque pixels."""
    from latentmill.stages.captioners.media import fit_within

    kind, frames, alphas = decoded if decoded is not None else decode_media(sample, meta, cfg, background)
    small = frames if cfg.decode_side() == cfg.score_side else [fit_within(f, cfg.score_side) for f in frames]
    opaque = None
    if alphas is not None:  # shrunk as their frames were
        opaque = [opaque_mask(a if a is None or a.size == f.size else a.resize(f.size, Image.Resampling.BICUBIC))
                  for a, f in zip(alphas, small)]
    return kind, score_frames(small, [n for n in names if n != "motion" or kind == "video"], opaque), frames


def decode_media(sample: dict[str, Any], meta: dict[str, Any], cfg: CurateConfig,
                 background: tuple[int, int, int] = pixels.WHITE) -> Decoded:
    """A sample decoded for scoring (:func:`decode_and_score`'s first half); the alpha of an image ingest
    found transparency in (``meta["alpha"]``, as the score keys read it) comes with it."""
    from latentmill.stages.captioners.media import load_image_alpha, load_media, media_member

    if meta.get("alpha") and (meta.get("kind") or "image") == "image":
        kind, member = media_member(sample, meta)
        if kind == "image":
            rgb, alpha = load_image_alpha(sample[member], cfg.decode_side(), background)
            return Decoded(kind, [rgb], [alpha])
    kind, frames, _ = load_media(sample, meta, cfg.frames, cfg.decode_side(), background)
    return Decoded(kind, frames)


def score_media(sample: dict[str, Any], meta: dict[str, Any], cfg: CurateConfig, names: list[str],
                background: tuple[int, int, int] = pixels.WHITE) -> dict[str, float]:
    """The named scores of one sample (model scorers included); see :func:`decode_and_score`."""
    kind, scores, frames = decode_and_score(sample, meta, cfg, names, background)
    needs = [n for n in names if n in MODEL_SCORERS]
    if needs:
        scores.update(curate_models.model_scores(cfg, [frames], [caption_text(sample, meta)], [needs])[0])
    return scores


def decode_frames(sample: dict[str, Any], meta: dict[str, Any], cfg: CurateConfig,
                  background: tuple[int, int, int] = pixels.WHITE) -> list[Image.Image]:
    """The frames scores and embeddings are computed from (one decode): the image, or ``cfg.frames`` frames
    spread over the video or its clip window, shrunk to ``cfg.score_side``."""
    from latentmill.stages.captioners.media import load_media

    _, frames, _ = load_media(sample, meta, cfg.frames, cfg.score_side, background)
    return frames


# ---------------------------------------------------------------------------------------------------------
# Score reuse across units and runs
# ---------------------------------------------------------------------------------------------------------




# ---------------------------------------------------------------------------------------------------------
# Exact duplicates
# ---------------------------------------------------------------------------------------------------------


class DedupIndex:
    """The content hashes seen so far, each with the sample that owns it (the first seen), in SQLite.

    ``owners`` maps a content sha256 to the key of the sample kept for it; ``scanned`` lists the upstream
    shards (by content hash) whose samples were entered; ``duplicates`` lists, per upstream shard, its samples
    that duplicate an owner; ``videos`` counts, per upstream shard, its video samples (a unit that holds
    videos has the clip plan in its fingerprint when they are scored per clip). Planning reads only shards
    not yet scanned (or, once, those scanned before ``videos`` existed), so a refresh costs its new data.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path))
        self.db.executescript(  # one transaction: a new index costs one commit (a few fsyncs), not three
            "BEGIN;"
            "CREATE TABLE IF NOT EXISTS owners (sha256 TEXT PRIMARY KEY, key TEXT NOT NULL);"
            "CREATE TABLE IF NOT EXISTS scanned (shard TEXT PRIMARY KEY);"
            "CREATE TABLE IF NOT EXISTS duplicates (shard TEXT NOT NULL, key TEXT NOT NULL, owner TEXT NOT NULL,"
            " PRIMARY KEY (shard, key));"
            "CREATE TABLE IF NOT EXISTS videos (shard TEXT PRIMARY KEY, videos INTEGER NOT NULL);"
            "COMMIT;")

    def knows(self, shard_sha: str) -> bool:
        """Whether this upstream shard's samples were entered (and its videos counted)."""
        return self.db.execute("SELECT 1 FROM videos WHERE shard = ?", (shard_sha,)).fetchone() is not None

    def scan(self, shard_sha: str, samples: list[tuple[str, str | None, str]], commit: bool = True) -> None:
        """Enter one upstream shard's samples ``(key, content sha256, kind)``, in order, once; ``commit=False``:
        in the caller's transaction (``with index.db``: one commit for many shards, not one each)."""
        with self.db if commit else contextlib.nullcontext():
            self.db.execute("INSERT OR REPLACE INTO videos VALUES (?, ?)",
                            (shard_sha, sum(1 for s in samples if s[2:] == ("video",))))
            if self.db.execute("SELECT 1 FROM scanned WHERE shard = ?", (shard_sha,)).fetchone():
                return
            for key, sha, *_ in samples:
                if not sha:
                    continue
                row = self.db.execute("SELECT key FROM owners WHERE sha256 = ?", (sha,)).fetchone()
                if row is None:
                    self.db.execute("INSERT INTO owners VALUES (?, ?)", (sha, key))
                elif row[0] != key:
                    self.db.execute("INSERT OR REPLACE INTO duplicates VALUES (?, ?, ?)", (shard_sha, key, row[0]))
            self.db.execute("INSERT INTO scanned VALUES (?)", (shard_sha,))

    def has_videos(self, shard_shas: list[str]) -> bool:
        """Whether any of these (scanned) upstream shards holds a video."""
        return any((self.db.execute("SELECT videos FROM videos WHERE shard = ?", (sha,)).fetchone() or (0,))[0]
                   for sha in shard_shas)

    def duplicates(self, shard_shas: list[str]) -> dict[str, str]:
        """Sample key -> owner key for the duplicates in these upstream shards."""
        found: dict[str, str] = {}
        for sha in shard_shas:
            found.update(self.db.execute("SELECT key, owner FROM duplicates WHERE shard = ?", (sha,)).fetchall())
        return found

    def close(self) -> None:
        self.db.close()


# ---------------------------------------------------------------------------------------------------------
# Plan and process
# ---------------------------------------------------------------------------------------------------------


def fingerprint(cfg: CurateConfig, background: tuple[int, int, int] = pixels.WHITE,
                clips: ClipSpec | None = None) -> dict[str, Any]:
    """The unit fingerprint: scorers and thresholds (a changed threshold re-runs units, which reuse scores).
    ``clips``: the clip plan videos are scored per clip by; it joins the fingerprint of the units that hold
    videos only (:func:`plan`), so an image-only recipe's units never depend on the bucket's clip keys."""
    fp: dict[str, Any] = {"stage": STAGE, "version": FORMAT_VERSION,
                          "scorers": [scorer_fingerprint(cfg, s, background) for s in cfg.active_scorers()],
                          "thresholds": cfg.thresholds(), "dedup": "sha256"}
    if cfg.dedup_threshold is not None:  # the units embed their samples; the threshold applies in bucket
        fp["embedder"] = cfg.embedder_fingerprint(background)
    if clips is not None:
        fp["clips"] = clips.fingerprint()
    return fp


def manifest_header(cfg: CurateConfig, background: tuple[int, int, int] = pixels.WHITE,
                    clips: ClipSpec | None = None) -> dict[str, Any]:
    """The manifest's fingerprint (with ``clips`` only when videos were scored per clip), scorers and
    thresholds."""
    header = {"fingerprint": stable_hash(fingerprint(cfg, background, clips)), "scorers": cfg.active_scorers(),
              "thresholds": cfg.thresholds()}
    if clips is not None:
        header["clips"] = clips.fingerprint()
    return header


def sample_hashes(tar: Path, index_entry: dict[str, Any] | None = None) -> list[tuple[str, str | None, str]]:
    """``(key, content sha256, kind)`` of every sample of an upstream shard, in order: only the json members
    are read, at the offsets of the shard index beside the tar (the whole tar when it has none)."""
    def facts(key: str, meta: dict[str, Any]) -> tuple[str, str | None, str]:
        return key, meta.get("sha256"), meta.get("kind") or "image"

    try:
        index = load_shard_index(tar, index_entry)
    except ShardIndexError:
        return [facts(s["__key__"], sample_json(s)) for s in read_shard(tar)]
    metas = read_ranges(tar, [index.members(i)["json"] for i in range(index.num_samples)])  # a store's: ranged
    return [facts(index.key(i), json.loads(meta)) for i, meta in enumerate(metas)]


def plan(cfg: CurateConfig, upstream: StageDir, stage_dir: StageDir | None = None,
         background: tuple[int, int, int] = pixels.WHITE, clips: ClipSpec | None = None) -> list[WorkUnit]:
    """Units of upstream shards grouped up to ``shard_bytes``; each unit's payload names the duplicates among
    its samples (``duplicates``: key -> owner key), from the dedup index, which first enters the samples of
    upstream shards it has not seen (in manifest order). With ``clips`` (the bucket stage's clip plan, so
    videos are scored per clip) a unit that holds a video has the plan in its fingerprint (its id)."""
    stage_dir = stage_dir if stage_dir is not None else sibling_stage(upstream, STAGE)
    units = units_by_bytes(upstream, fingerprint(cfg, background), cfg.shard_bytes, stage_dir,
                           copy_estimate(256))
    index = DedupIndex(stage_dir.root / DEDUP_FILE)
    try:
        with index.db:  # the new shards in one transaction: one commit (a few fsyncs), not one per shard
            for entry in upstream.read_manifest()["shards"]:
                if not index.knows(entry["sha256"]):
                    index.scan(entry["sha256"], sample_hashes(upstream.root / entry["path"], entry.get("index")),
                               commit=False)
        for unit in units:
            unit.payload["duplicates"] = index.duplicates(unit.inputs)
            if clips is not None and index.has_videos(unit.inputs):
                unit.unit_id = grouped_unit_id(fingerprint(cfg, background, clips), unit.inputs)
                unit.payload["clips"] = True
    finally:
        index.close()
    return units


@dataclass
class _Scored:
    """One sample on its way through :func:`_score_unit`."""

    sample: dict[str, Any]
    meta: dict[str, Any]
    keys: dict[str, str] = field(default_factory=dict)  # score name -> score key (the scores it has)
    values: dict[str, float] = field(default_factory=dict)
    computed: bool = False  # decoded and scored here (else every score was found by key)
    error: str | None = None  # the decode error of a sample that cannot be scored (quarantined)
    frames: list[Image.Image] | None = None  # decoded frames, while model scores are missing
    needs: list[str] = field(default_factory=list)  # model scores still missing
    small: list[Image.Image] | None = None  # the frames decode_frames gives, kept for an embedding
    missing: list[str] = field(default_factory=list)  # scores to compute when its chunk is decoded


def _score_unit(cfg: CurateConfig, unit: WorkUnit, prints: dict[str, dict[str, Any]],
                known: Callable[[str], float | None],
                skip: set[str], background: tuple[int, int, int], keep_small: bool = False,
                per_clip: bool = False) -> Iterator[_Scored]:
    """The unit's samples in order, each with its scores: found by key, else decoded once and scored, up to
    ``cfg.batch_size`` samples at a time (decoded frames are held for that many samples only), the model
    scores in batched forwards. Samples in ``skip`` (duplicates) come through unscored. With ``keep_small``
    a sample decoded here keeps its frames as :func:`decode_frames` gives them (``small``, for its near-dup
    embedding) when they are the frames it was scored on (no model scorer asked for a larger decode). With
    ``per_clip`` videos come through unscored too: :func:`_process_video_clips` scores them per clip."""
    names = list(prints)
    keyers = {name: ScoreKeyer(fp) for name, fp in prints.items()}
    chunk: list[_Scored] = []

    def score(item: _Scored, decoded: Decoded) -> None:
        kind = item.meta.get("kind") or "image"
        try:
            decoded_kind, computed, frames = decode_and_score(item.sample, item.meta, cfg, item.missing,
                                                              background, decoded)
        except Exception as err:  # PIL / decord / PyAV errors
            item.error = f"{type(err).__name__}: {err}"
        else:
            if decoded_kind != kind:  # a video member without "kind": no motion was keyed for it
                computed.pop("motion", None)
            item.values.update(computed)
            item.needs = [name for name in item.missing if name in MODEL_SCORERS]
            item.frames = frames if item.needs else None
            if keep_small and cfg.decode_side() == cfg.score_side:
                item.small = frames

    def flush() -> Iterator[_Scored]:
        # The chunk's samples are decoded first, then scored: alternating the two sample by sample churns
        # libjpeg's and numpy's buffers through the allocator.
        decoded: list[tuple[_Scored, Decoded]] = []
        for item in chunk:
            if item.missing:
                try:
                    decoded.append((item, decode_media(item.sample, item.meta, cfg, background)))
                except Exception as err:  # PIL / decord / PyAV errors
                    item.error = f"{type(err).__name__}: {err}"
        for item, media in decoded:
            score(item, media)
        del decoded
        waiting = [s for s in chunk if s.needs]
        if waiting:
            found = curate_models.model_scores(cfg, [s.frames or [] for s in waiting],
                                               [caption_text(s.sample, s.meta) for s in waiting],
                                               [s.needs for s in waiting])
            for item, values in zip(waiting, found):
                item.values.update(values)
        for item in chunk:
            item.frames = None
            yield item
        chunk.clear()

    for sample in iter_unit_samples(unit):
        item = _Scored(sample, sample_json(sample))
        chunk.append(item)
        if sample["__key__"] not in skip and not (per_clip and item.meta.get("kind") == "video"):
            kind = item.meta.get("kind") or "image"
            text = caption_text(sample, item.meta) if "clip_score" in names else None
            item.keys = {name: keyers[name](item.meta, text if name == "clip_score" else None)
                         for name in names if name != "motion" or kind == "video"}  # an image has no motion
            item.values = {name: v for name, k in item.keys.items() if (v := known(k)) is not None}
            missing = [name for name in item.keys if name not in item.values]
            if missing:
                item.computed = True
                item.missing = missing  # decoded and scored with its chunk (flush)
        if len(chunk) >= cfg.batch_size:  # decoded frames are held for a chunk, with or without models
            yield from flush()
    yield from flush()


def undecodable_reason(error: str) -> str:
    """The quarantine reason of a sample the stage cannot decode (the cache stage's words for the same)."""
    return f"cannot decode pixels: {error}"


def process(cfg: CurateConfig, unit: WorkUnit, out: UnitOutput,
            background: tuple[int, int, int] = pixels.WHITE, clips: ClipSpec | None = None) -> None:
    """Drop the unit's duplicates, score the others (reusing scores by key), apply the thresholds. With
    ``clips`` (the bucket stage's clip plan) a video is scored and thresholded per clip
    (:func:`_process_video_clips`). Scores and embeddings already computed are found by key in the output
    folder's catalog (``stages.catalog``)."""
    with out.stage_dir.lookup() as found:
        _process(cfg, unit, out, background, clips, found)


def _process(cfg: CurateConfig, unit: WorkUnit, out: UnitOutput, background: tuple[int, int, int],
             clips: ClipSpec | None, found: Lookup) -> None:
    """:func:`process` with the catalog open."""
    names = cfg.active_scorers()
    prints = {name: scorer_fingerprint(cfg, name, background) for name in names}
    thresholds = cfg.thresholds()
    duplicates: dict[str, str] = unit.payload.get("duplicates") or {}
    rows: dict[str, dict[str, Any]] = {}
    counts = {"scored": 0, "scores_reused": 0, "unscored": 0, "duplicates": 0, "below_threshold": 0}
    # near duplicates: the embedding of every kept sample, by key (stages/neardup.py)
    embed = ((lambda frames: curate_models.image_embeddings(cfg, [frames])[0]) if cfg.embeds_with_model()
             else None)  # None: the pixel thumbnail (neardup.thumbnail_embedding)
    embeds = (neardup.UnitEmbeddings(out.stage_dir.root, unit.unit_id, cfg.embedder_fingerprint(background),
                                     found, embed) if cfg.dedup_threshold is not None else None)
    for item in _score_unit(cfg, unit, prints, found.score, set(duplicates), background, keep_small=embeds is not None,
                            per_clip=clips is not None):
        sample, meta, key = item.sample, item.meta, item.sample["__key__"]
        source, kind = meta.get("source", "?"), meta.get("kind") or "image"
        if key in duplicates:
            counts["duplicates"] += 1
            out.quarantine(key, source, "exact duplicate (same content sha256)", duplicate_of=duplicates[key])
            continue
        if clips is not None and kind == "video":
            _process_video_clips(cfg, clips, item, prints, found.score, out, rows, counts, embeds, background)
            continue
        if item.error is not None:  # quarantined where it is first decoded, not passed on to the cache
            counts["unscored"] += 1
            out.quarantine(key, source, undecodable_reason(item.error))
            continue
        counts["scored" if item.computed else "scores_reused"] += 1
        scores = {name: round(item.values[name], 6) for name in names if name in item.keys}
        rows[key] = {"source": source, "kind": kind, "keys": item.keys, "values": scores}
        failed = [(name, scorer, bound) for name, bound in thresholds.items()
                  for scorer, side in [THRESHOLDS[name]]
                  if scorer in scores  # an image has no motion score
                  and (scores[scorer] < bound if side == "min" else scores[scorer] > bound)]
        if failed:  # every threshold it fails, in THRESHOLDS order
            counts["below_threshold"] += 1
            rows[key]["quarantined"] = ",".join(f"curate.{name}" for name, _, _ in failed)
            out.quarantine(key, source, "; ".join(f"{scorer} beyond curate.{name}={bound:g}"
                                                  for name, scorer, bound in failed), scores=scores)
            continue
        meta["scores"] = scores
        if embeds is not None:
            embeds.add(key, meta, lambda it=item: it.small or decode_frames(it.sample, it.meta, cfg, background))
        out.add({**sample, "json": meta_bytes(meta)}, part=kind)
    if embeds is not None:
        counts.update(embedded=embeds.computed, embeddings_reused=embeds.reused)
        written = embeds.write()
        if written is not None:
            out.extra["embeddings"] = written
    out.detail["scores"] = rows
    out.extra["counts"] = counts
    write_unit_table(out, rows, names)


def _process_video_clips(cfg: CurateConfig, spec: ClipSpec, item: _Scored, prints: dict[str, dict[str, Any]],
                         known: Callable[[str], float | None], out: UnitOutput, rows: dict[str, dict[str, Any]],
                         counts: dict[str, int], embeds: neardup.UnitEmbeddings | None,
                         background: tuple[int, int, int]) -> None:
    """One video scored per clip (:mod:`latentmill.stages.curate_clips`): its clips' verdicts go into its
    json (``clip_scores``) for the bucket stage, one scores-table row per clip (key ``<key>-c<j>``, kind
    ``clip``); a video whose every clip fails a threshold is quarantined whole."""
    from latentmill.stages import curate_clips

    sample, meta, key = item.sample, item.meta, item.sample["__key__"]
    source = meta.get("source", "?")
    names = list(prints)
    text = caption_text(sample, meta) if "clip_score" in names else None
    # the near-dup embedding stays per video: its frames join the decode pass when it is not stored yet
    embed_missing = embeds is not None and embeds.stored(neardup.embedding_key(embeds.fp_hash, meta)) is None
    video = curate_clips.score_video(cfg, sample, meta, spec, prints, known, text, background,
                                     whole_frames=embed_missing)
    if video.error is not None:  # its clips could not be planned or decoded: quarantined, as an image
        counts["unscored"] += 1
        out.quarantine(key, source, undecodable_reason(video.error))
        return
    if video.cuts is not None:
        meta["scene_cuts"], meta["scene_threshold"] = video.cuts, spec.scene_threshold
    entries, fails = curate_clips.verdicts(video, names, cfg.thresholds())
    for j, (clip, entry, failed) in enumerate(zip(video.clips, entries, fails)):
        rows[curate_clips.clip_key(key, j)] = {"source": source, "kind": curate_clips.CLIP_KIND, "video": key,
                                              "keys": clip.keys, "values": entry["scores"],
                                              **({"quarantined": ",".join(f"curate.{n}" for n, _, _ in failed)}
                                                 if failed else {})}
    counts["clips_scored"] = counts.get("clips_scored", 0) + sum(c.computed for c in video.clips)
    counts["clip_scores_reused"] = counts.get("clip_scores_reused", 0) + sum(not c.computed for c in video.clips)
    counts["clips_below_threshold"] = counts.get("clips_below_threshold", 0) + sum(bool(f) for f in fails)
    out.extra["clip_videos"] = out.extra.get("clip_videos", 0) + 1
    if video.clips:
        counts["scored" if video.computed else "scores_reused"] += 1
    if video.clips and all(fails):  # every clip fails: the video goes whole, here
        counts["below_threshold"] += 1
        out.quarantine(key, source, curate_clips.whole_video_reason(fails), clip_scores=entries)
        return
    meta["clip_scores"] = entries  # empty: too short for a clip (the bucket stage says so)
    meta.pop("scores", None)
    if embeds is not None:
        embeds.add(key, meta, lambda: video.small or decode_frames(sample, meta, cfg, background))
    out.add({**sample, "json": meta_bytes(meta)}, part="video")


def report(records: list[UnitRecord]) -> dict[str, Any]:
    """Scorer calls, reused scores, duplicates and threshold drops of the units this run ran (a reused unit
    neither scores nor reuses), and quarantines per reason over the whole stage."""
    per_clip = ("clips_scored", "clip_scores_reused", "clips_below_threshold")
    names = ("scored", "scores_reused", "unscored", "embedded", "embeddings_reused") + per_clip
    totals = dict.fromkeys(names, 0)
    reasons: dict[str, int] = {}
    clip_counts = False
    for record in records:  # one pass (a StageRecords reads each record from disk)
        counts = record.extra.get("counts") or {}
        clip_counts = clip_counts or any(name in counts for name in per_clip)
        if not record.reused:
            for name in names:
                totals[name] += int(counts.get(name, 0))
        for q in record.quarantined:
            reasons[q["reason"]] = reasons.get(q["reason"], 0) + 1
    result: dict[str, Any] = {name: totals[name] for name in names[:5]}
    result["quarantined_by_reason"] = dict(sorted(reasons.items()))
    if clip_counts:
        result.update({name: totals[name] for name in per_clip})
    return result


SCORES_FILE = "scores.parquet"
TABLE_KEY = "scores_table"  # a record's extra field: its unit's rows of the scores table (a Parquet file)
SCORE_TEXT_COLUMNS = ("key", "source", "kind", "status", "threshold")


def score_rows(stage_dir: StageDir, records: Iterable[UnitRecord]) -> list[dict[str, Any]]:
    """One row per scored sample of the stage: key, source, kind, status and every score."""
    rows = [row for record in records
            for row in _table_rows(stage_dir.unit_detail(record).get("scores") or {})]
    return sorted(rows, key=lambda r: r["key"])


def _table_rows(scores: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The scores table's rows of one unit's score rows (``scores`` of its detail), in key order."""
    return [{"key": key, "source": row["source"], "kind": row["kind"],
             "status": "quarantined" if row.get("quarantined") else "kept",
             "threshold": row.get("quarantined"), **row["values"]} for key, row in sorted(scores.items())]


def _arrow_table(rows: list[dict[str, Any]], names: list[str]):
    """``rows`` (:func:`_table_rows`) as an Arrow table of the scores table's schema."""
    import pyarrow as pa

    schema = pa.schema([(c, pa.string()) for c in SCORE_TEXT_COLUMNS] + [(n, pa.float64()) for n in names])
    return pa.table({**{c: pa.array([r[c] for r in rows], pa.string()) for c in SCORE_TEXT_COLUMNS},
                     **{n: pa.array([r.get(n) for r in rows], pa.float64()) for n in names}}, schema=schema)


def write_unit_table(out: UnitOutput, scores: dict[str, dict[str, Any]], names: list[str]) -> None:
    """The unit's rows of ``prep/scores.parquet`` as a Parquet file beside its shards, named in its record
    (``extra["scores_table"]``), so that the stage's table is put together from one file per unit; none
    without pyarrow or without a scored sample."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return
    rows = _table_rows(scores)
    if not rows:
        return
    name = f"{out.stage_dir.stage}-{out.unit.unit_id[:16]}-scores.parquet"
    path = out.stage_dir.shard_dir / name
    tmp = path.with_name(name + ".tmp")
    pq.write_table(_arrow_table(rows, names), tmp)
    tmp.replace(path)
    out.extra[TABLE_KEY] = f"shards/{name}"


def write_scores_table(records: Iterable[UnitRecord], prep_dir: Path, names: list[str]) -> Path | None:
    """``prep/scores.parquet`` from the stage's records (rewritten every run), when pyarrow is installed
    (``pip install 'latentmill[parquet]'``); None without it. Columns: key, source, kind, status,
    threshold (those that dropped the sample, comma-separated, or null), and one float column per scorer;
    rows in key order (as :func:`score_rows`). Put together from each unit's Parquet file (a unit committed
    before those: from its score rows), so a unit reused costs a file read, not a row each.
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None
    stage_dir = StageDir(Path(prep_dir) / STAGE, STAGE)
    schema = _arrow_table([], names).schema
    parts = []
    for record in by_unit_id(records):
        name = record.extra.get(TABLE_KEY)
        part = pq.read_table(stage_dir.root / name) if name else None
        if part is None or not part.schema.equals(schema):  # no file (an older unit), or other scorers
            rows = _table_rows(stage_dir.unit_detail(record).get("scores") or {})
            part = _arrow_table(rows, names) if rows else None
        if part is not None:
            parts.append(part)
    table = pa.concat_tables(parts).sort_by("key").combine_chunks() if parts else schema.empty_table()
    path = Path(prep_dir) / SCORES_FILE
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path
