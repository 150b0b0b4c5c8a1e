"""The curate stage's model-free scores and its score keys: what ``curate`` and ``curate_clips`` both use.

``sharpness`` and ``exposure`` (numpy, on the grey image; an image with transparency on its opaque pixels),
``score_frames`` (an image's scores, or a video's means over its frames, ``motion`` too), the threshold table,
and ``score_key`` / ``ScoreKeyer`` (a score component's key). The stage itself, its config and the scorer
fingerprints are :mod:`latentmill.stages.curate`'s; the per-clip scores of videos are
:mod:`latentmill.stages.curate_clips`'. Both import this module, and it imports neither.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from latentmill.stages import curate_models
from PIL import Image

from latentmill.core.hashing import canonical_json, sha256_bytes, stable_hash

# An image's pixels with at least this alpha are the picture that sharpness and exposure score (the others
# show the background); in the score keys of images with transparency, so the scores of opaque ones stay.
OPAQUE_ALPHA = 128
MASKED_SCORERS = ("sharpness", "exposure")
# threshold key -> (scorer, "min" | "max")
THRESHOLDS = {"min_sharpness": ("sharpness", "min"), "max_exposure": ("exposure", "max"),
              "min_aesthetic": ("aesthetic", "min"), "min_clip_score": ("clip_score", "min"),
              "min_motion": ("motion", "min"), "max_motion": ("motion", "max")}


def grey(img: Image.Image) -> np.ndarray:
    """``img`` as float64 grey levels 0..255 (ITU-R 601 luma, as Pillow's ``L`` mode)."""
    return np.asarray(img.convert("L"), dtype=np.float64)


def sharpness(grey_HW: np.ndarray, opaque_HW: np.ndarray | None = None) -> float:
    """Variance of the 4-neighbour Laplacian over the image's interior (0 for an image under 3x3); with
    ``opaque_HW``, over the pixels whose whole stencil is opaque (0 when there is none)."""
    if grey_HW.shape[0] < 3 or grey_HW.shape[1] < 3:
        return 0.0
    g = grey_HW
    # g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4.0 * g[1:-1, 1:-1], summed in that order
    # (the same bits) into one buffer instead of a new array per term
    lap = g[:-2, 1:-1] + g[2:, 1:-1]
    lap += g[1:-1, :-2]
    lap += g[1:-1, 2:]
    lap -= 4.0 * g[1:-1, 1:-1]
    if opaque_HW is None:
        return float(lap.var())
    o = opaque_HW  # the pixels whose stencil holds no background
    inside = o[1:-1, 1:-1] & o[:-2, 1:-1] & o[2:, 1:-1] & o[1:-1, :-2] & o[1:-1, 2:]
    return float(lap[inside].var()) if inside.any() else 0.0


def exposure(grey_HW: np.ndarray, opaque_HW: np.ndarray | None = None) -> float:
    """The share of pixels clipped to black (0) or white (255); with ``opaque_HW``, of the opaque pixels."""
    clipped = (grey_HW <= 0.0) | (grey_HW >= 255.0)
    if opaque_HW is not None:
        clipped = clipped[opaque_HW]
    return float(np.mean(clipped)) if clipped.size else 0.0


def opaque_mask(alpha: Image.Image | None) -> np.ndarray | None:
    """The pixels with alpha at least ``OPAQUE_ALPHA``; None (score every pixel) without alpha, or when all
    or none of them are opaque (a fully transparent image is scored as it is shown: the background)."""
    if alpha is None:
        return None
    mask = np.asarray(alpha) >= OPAQUE_ALPHA
    return mask if mask.any() and not mask.all() else None


SCORE_FUNCTIONS: dict[str, Callable[..., float]] = {"sharpness": sharpness, "exposure": exposure}


def scored_on_opaque(scorer_fp: dict[str, Any], meta: dict[str, Any]) -> bool:
    """Whether this scorer scores this sample on its opaque pixels: an image ingest found transparency in."""
    return (scorer_fp.get("scorer") in MASKED_SCORERS and bool(meta.get("alpha"))
            and (meta.get("kind") or "image") == "image")


def score_key(scorer_fp: dict[str, Any], meta: dict[str, Any], text: str | None = None) -> str:
    """A score component's key: the scorer's fingerprint, the sample's content hash and its clip window, for
    a score of the caption too (``clip_score``) the caption, and for one on opaque pixels only their alpha
    threshold."""
    parts = {"scorer": scorer_fp, "sha256": meta.get("sha256"), "clip": meta.get("clip")}
    if scored_on_opaque(scorer_fp, meta):
        parts["opaque"] = OPAQUE_ALPHA
    if text is not None:
        parts["text"] = text
    return stable_hash(parts)


class ScoreKeyer:
    """:func:`score_key` for one scorer fingerprint, with the fingerprint's canonical JSON encoded once (a
    model scorer's fingerprint holds the model's and head's digests: encoding it for every sample was most of
    a key's cost). The keys are :func:`score_key`'s, byte for byte: ``stable_hash`` of the same dict, whose
    text is its parts' texts in key order (``clip``, ``opaque``, ``scorer``, ``sha256``, ``text``)."""

    def __init__(self, scorer_fp: dict[str, Any]):
        self.scorer_fp = scorer_fp
        self.scorer_json = canonical_json(scorer_fp)

    def __call__(self, meta: dict[str, Any], text: str | None = None) -> str:
        opaque = f'"opaque":{OPAQUE_ALPHA},' if scored_on_opaque(self.scorer_fp, meta) else ""
        doc = (f'{{"clip":{canonical_json(meta.get("clip"))},{opaque}"scorer":{self.scorer_json},'
               f'"sha256":{canonical_json(meta.get("sha256"))}')
        if text is not None:
            doc += f',"text":{canonical_json(text)}'
        return sha256_bytes((doc + "}").encode())


def _mean(values: list[float]) -> float:
    """``np.mean`` of per-frame values; an image's one value as it is (the same float, without numpy's call)."""
    return float(values[0]) if len(values) == 1 else float(np.mean(values))


def score_frames(frames: list[Image.Image], names: list[str],
                 opaque: list[np.ndarray | None] | None = None) -> dict[str, float]:
    """Each named model-free score of an image (one frame) or a video (the mean over its frames; ``motion``
    over consecutive frames); ``opaque``: per frame, the pixels to score (:func:`opaque_mask`)."""
    greys = [grey(f) for f in frames]
    masks = opaque or [None] * len(greys)
    scores = {name: _mean([SCORE_FUNCTIONS[name](g) if m is None else SCORE_FUNCTIONS[name](g, m)
                           for g, m in zip(greys, masks)])
              for name in names if name in SCORE_FUNCTIONS}
    if "motion" in names:
        scores["motion"] = curate_models.motion(greys)
    return scores
