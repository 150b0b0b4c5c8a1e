"""Bucket: give every sample a target size (width, height, frames) and group samples by it.

A bucket is the size whose aspect ratio is nearest the sample's (in log space) among the configured
ratios, scaled to the pixel budget ``resolution²`` and rounded to multiples of ``step``. The stage only
decides sizes and the crop; pixels are resized and cropped once, in the cache stage. Each output shard holds
one bucket, so a batch drawn from a shard never mixes shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stages.shardio import (
    StageDir,
    UnitOutput,
    WorkUnit,
    json_bytes,
    read_shard,
    sample_json,
    units_per_shard,
)

STAGE = "bucket"
DEFAULT_ASPECT_RATIOS = [0.5, 0.5625, 0.6667, 0.75, 1.0, 1.3333, 1.5, 1.7778, 2.0]


@dataclass
class BucketConfig:
    """Pixel budget, admissible aspect ratios and size quantisation."""

    resolution: int = 512  # pixel budget is resolution × resolution
    aspect_ratios: list[float] = field(default_factory=lambda: list(DEFAULT_ASPECT_RATIOS))
    step: int = 16  # sizes are multiples of this (Flux-class: 8× VAE × 2×2 packing)
    crop: str = "center"

    def validate(self) -> None:
        from latentmill.config import ConfigError

        if self.step < 1 or self.step % 16:
            raise ConfigError(f"bucket.step: must be a positive multiple of 16, got {self.step}")
        if self.resolution < self.step:
            raise ConfigError(f"bucket.resolution: must be >= bucket.step ({self.step}), got {self.resolution}")
        if not self.aspect_ratios or any(a <= 0 for a in self.aspect_ratios):
            raise ConfigError("bucket.aspect_ratios: needs at least one positive width/height ratio")
        if self.crop != "center":
            raise ConfigError(f"bucket.crop: {self.crop!r} is not one of 'center'")


def bucket_sizes(cfg: BucketConfig) -> dict[float, tuple[int, int]]:
    """Map every aspect ratio to its (width, height) at the pixel budget, multiples of ``step``."""
    budget = cfg.resolution * cfg.resolution
    sizes = {}
    for ratio in sorted(set(cfg.aspect_ratios)):
        width = max(cfg.step, round(math.sqrt(budget * ratio) / cfg.step) * cfg.step)
        height = max(cfg.step, round(math.sqrt(budget / ratio) / cfg.step) * cfg.step)
        sizes[ratio] = (width, height)
    return sizes


def bucket_for(width: int, height: int, cfg: BucketConfig, frames: int = 1) -> tuple[int, int, int]:
    """The (width, height, frames) bucket of a ``width``×``height`` sample."""
    sizes = bucket_sizes(cfg)
    aspect = math.log(width / height)
    ratio = min(sizes, key=lambda r: (abs(math.log(r) - aspect), r))
    bw, bh = sizes[ratio]
    return bw, bh, frames


def crop_for(width: int, height: int, bucket: tuple[int, int, int]) -> dict[str, int]:
    """Resize-to-cover then center-crop parameters that turn ``width``×``height`` into the bucket size."""
    bw, bh, _ = bucket
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    return {"resize_width": rw, "resize_height": rh, "left": (rw - bw) // 2, "top": (rh - bh) // 2}


def fingerprint(cfg: BucketConfig) -> dict[str, Any]:
    return {"stage": STAGE, "version": 1, "sizes": sorted(bucket_sizes(cfg).values()), "crop": cfg.crop}


def plan(cfg: BucketConfig, upstream: StageDir) -> list[WorkUnit]:
    """One unit per upstream shard; each unit writes one shard per bucket it meets."""
    return units_per_shard(upstream, fingerprint(cfg))


def process(cfg: BucketConfig, unit: WorkUnit, out: UnitOutput) -> None:
    """Assign each sample its bucket and crop, writing it to that bucket's shard."""
    for sample in read_shard(unit.payload["shard"]):
        meta = sample_json(sample)
        bucket = bucket_for(meta["width"], meta["height"], cfg)
        meta["bucket"] = list(bucket)
        meta["crop"] = {"policy": cfg.crop, **crop_for(meta["width"], meta["height"], bucket)}
        part = "x".join(map(str, bucket))
        out.add({**sample, "json": json_bytes(meta)}, part=part, bucket=list(bucket))


def histogram(manifest: dict[str, Any]) -> dict[str, int]:
    """Samples per bucket (``"WxHxF"``) in a bucket or cache manifest."""
    counts: dict[str, int] = {}
    for shard in manifest["shards"]:
        key = "x".join(map(str, shard["bucket"]))
        counts[key] = counts.get(key, 0) + shard["samples"]
    return dict(sorted(counts.items()))
